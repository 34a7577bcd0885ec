"""The Ray Data pipeline: readers → cleaning + split + directions → prompts + tokenize (actor pool) → one
sort by a seeded hash of the pair → per partition: dedup, weights, order → pack.

The result is two datasets of training rows in a fixed order (same seed, same rows, same order on every
run and worker count) plus the statistics of what was kept and dropped. The training rows are cut into
blocks of one lane of a window (:func:`~raytrain_hymt.data.epochs.block_rows`): each epoch assigns every
position of every global batch to a lane, a contiguous stretch of the stream, before anything is read
(:mod:`~raytrain_hymt.data.epochs`), and each training rank fetches only the blocks of its own lanes
(:mod:`~raytrain_hymt.data.blocks`). Batches do not depend on the worker count, and a restarted run
skips the rows it already trained on without reading them. Validation rows are not split: every rank
reads the whole validation stream and evaluates its slice of each batch.

One sort serves dedup and order: its key is a seeded hash of the pair (``group_key``), so every copy
of a pair (duplicates, weighted copies, both directions) lands in one partition, and which pairs share
a partition is seeded (the partitions themselves follow each other in their fixed hash-range order). Within a partition, duplicates are marked, weights
applied and the examples ordered by the seeded ``order_key``; packing then takes each partition whole.

Determinism: every per-row decision is a hash of the row (split: the source sentence; partition: the
seeded pair hash; order within it: the seeded ``order_key``; weights: the ``example_id``), the dedup keeps
the smallest ``example_id`` of each pair, and the sort uses fixed partition boundaries, so even the block
layout that packing sees is the same on every run (Ray's sort samples its boundaries at random when none
are given).

``build_datasets`` materializes its results (each training rank then fetches its blocks from the object
store, not the pipeline again). For corpora larger than the cluster's object store, ``hymt prepare`` writes the rows to
Parquet once (:mod:`raytrain_hymt.driver.train`, :mod:`raytrain_hymt.data.prepared`) and ``data.prepared_path`` streams them from there.

Ray Data's actor pools here (the tokenizers of this pipeline, the translating replicas of evaluation)
run on :func:`map_on_actors`, whose actors Ray never restarts. Ray Data starts every pool actor with
``max_restarts=-1`` unless told otherwise, and always hands it object references as constructor
arguments (its DataContext and the fused map functions); Ray Core then prints, once per driver, an
ERROR line from ``core_worker.cc`` ("Actor with class name: 'MapWorker(...)' ... has constructor
arguments in the object store and max_restarts > 0"). ``max_restarts=0`` removes that cause. It also
means that a pool actor that dies (a crash in the tokenizer, an OOM kill) fails the execution with the
error, where a restarted actor would be handed the same batch again without end (Ray Data also sets
``max_task_retries=-1`` then), which turns a crash that repeats into a hang. An actor that dies while
it is still starting is replaced by Ray Data either way.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import warnings

import numpy as np
import pyarrow as pa

from raytrain_hymt.config.schema import Config, DataConfig
from raytrain_hymt.data.cleaning import (
    CleaningRules,
    check_bad_fraction,
    clean_batch,
    format_sample,
    pair_key,
    split_key,
)
from raytrain_hymt.data.epochs import block_rows
from raytrain_hymt.data.files import file_size
from raytrain_hymt.data.packing import as_single_rows, pack_examples
from raytrain_hymt.data.prompts import expand_directions, resolve_family
from raytrain_hymt.data.sources import plan_source, read_units
from raytrain_hymt.data.stats import DataStats, fill_row_stats
from raytrain_hymt.data.tokenize import TokenizePairs
from raytrain_hymt.errors import DataSourceError

log = logging.getLogger(__name__)

BAD_LINE_REASONS = ("malformed", "invalid_utf8")
#: Rows per block between reading and tokenizing (the unit of parallel work).
ROWS_PER_BLOCK = 8192
#: What ``data.sort_partitions: auto`` aims at: bytes of tokenized examples per sort partition (one
#: block, deduplicated and packed whole by one task, with one part-filled row each).
PARTITION_BYTES = 128 * 2**20
#: Bytes of tokenized examples (Arrow token lists, ids, keys) per byte of corpus file (4.7 measured on the
#: bundled sample, a TSV); ``.gz`` files count 4× their size (see :func:`sort_partitions`).
TOKENIZED_BYTES_PER_INPUT_BYTE = 5.0
#: Columns of the sorted examples (texts are gone after tokenizing; bad rows keep a short ``sample``).
SORTED_COLUMNS = ("input_ids", "labels", "example_id", "source", "direction", "num_tokens", "num_targets",
                  "drop_reason", "is_val", "sample", "pair_key", "group_key")
#: Columns of the materialized tokenized dataset, in seeded order within each partition.
TOKENIZED_COLUMNS = ("input_ids", "labels", "example_id", "num_tokens", "num_targets", "drop_reason", "is_val",
                     "primary", "sample")


def cleaning_rules(data: DataConfig) -> CleaningRules:
    """The pure cleaning rules from the data config."""
    return CleaningRules(
        min_chars=data.min_chars,
        max_chars=data.max_chars,
        max_length_ratio=data.max_length_ratio,
        drop_identical=data.drop_identical,
        on_unsupported_language=data.on_unsupported_language,
        language_id=data.language_id,
    )


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def order_key(example_ids: np.ndarray, directions: np.ndarray, seed: int) -> np.ndarray:
    """Seeded pseudo-random sort key per example: a shuffle that is the same on every machine."""
    return np.array([_hash64(f"{seed}|{int(e)}|{int(d)}") for e, d in zip(example_ids, directions)], dtype=np.int64)


def group_key(pair_keys: np.ndarray, example_ids: np.ndarray, seed: int) -> np.ndarray:
    """Key of the one sort: a seeded 64-bit hash of the ``pair_key`` (equal pairs get equal keys, so they
    meet in one partition, and the seed shuffles the partitions' contents); a row without a pair key
    (dropped in cleaning) gets its ``example_id``, which spreads those rows evenly."""
    return np.array([_hash64(f"{seed}|{k}") if k else int(e) for k, e in zip(pair_keys, example_ids)], dtype=np.int64)


def uniform_boundaries(partitions: int) -> list[int]:
    """Boundaries splitting the int64 range into equal partitions (for uniform hash keys); at least
    two partitions, because Ray treats an empty list as "sample boundaries at random"."""
    edges = np.linspace(np.iinfo(np.int64).min, np.iinfo(np.int64).max, max(2, partitions) + 1, dtype=np.float64)[1:-1]
    return [int(e) for e in edges]


def mark_duplicates(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """In a block holding whole ``pair_key`` groups, mark every pair but the smallest ``example_id`` of
    its group ``duplicate`` (the result does not depend on the row order within the block)."""
    first: dict[str, tuple[int, int]] = {}
    for i, (key, eid) in enumerate(zip(batch["pair_key"], batch["example_id"])):
        if key and (key not in first or eid < first[key][0]):
            first[key] = (int(eid), i)
    keep = {i for _, i in first.values()}
    reasons = np.array(batch["drop_reason"], dtype=object)
    for i, key in enumerate(batch["pair_key"]):
        if key and i not in keep:
            reasons[i] = "duplicate"
    batch["drop_reason"] = reasons
    return batch


def apply_weights(batch: dict[str, np.ndarray], weights: list[float], seed: int) -> dict[str, np.ndarray]:
    """Repeat or subsample rows by their source's weight (``2.5``: twice, plus a third copy for half the
    rows). Which rows get the fractional copy is a seeded hash of the ``example_id`` (deterministic, and
    the same for both directions of a pair); a row sampled away is marked ``subsampled``; copy ``k > 0``
    gets a new ``example_id`` derived from the original. Rows that are kept or only too long
    (``too_many_tokens`` counts every example a pair would have made) are weighted; other dropped rows
    stay as one row, to be counted.

    Needs ``example_id``, ``source`` and ``drop_reason``; returns ``index`` (the input row of each output
    row), ``copy`` (0 for the original), ``example_id`` and ``drop_reason`` of the output rows.
    """
    eids = np.asarray(batch["example_id"], dtype=np.int64)
    index: list[int] = []
    copies: list[int] = []
    reasons = list(batch["drop_reason"])
    for i, (e, s) in enumerate(zip(eids.tolist(), np.asarray(batch["source"]).tolist())):
        w = weights[s]
        whole, frac = int(w), w - int(w)
        u = (_hash64(f"{seed}|weight|{e}") / 2**64) + 0.5
        count = whole + (u < frac)
        if reasons[i] not in ("", "too_many_tokens") or count <= 1:
            index.append(i)
            copies.append(0)
            if count == 0 and reasons[i] in ("", "too_many_tokens"):
                reasons[i] = "subsampled"
        else:
            index.extend([i] * count)
            copies.extend(range(count))
    out_index = np.array(index, dtype=np.int64)
    return {
        "index": out_index,
        "copy": np.array(copies, dtype=np.int32),
        "drop_reason": np.array(reasons, dtype=object)[out_index],
        "example_id": np.array([e if c == 0 else _hash64(f"{e}|copy|{c}") for e, c in zip(eids[out_index].tolist(), copies)],
                               dtype=np.int64),
    }


def prepare_pairs(batch: dict[str, np.ndarray], rules: CleaningRules, seed: int, val_fraction: float,
                  both: bool) -> dict[str, np.ndarray]:
    """Everything before tokenizing, in one pass over a block of read pairs (one conversion between
    Arrow and NumPy instead of one per step): clean, key each kept pair for the sort (``pair_key``,
    ``group_key``), mark the validation split, keep a short ``sample`` of each bad line, add reversed
    pairs (``direction`` 1)."""
    batch = {k: np.asarray(v, dtype=object) if isinstance(v, list) else v for k, v in clean_batch(batch, rules).items()}
    keep = batch["drop_reason"] == ""
    # Dropped rows get no key: they never count as the "first" copy of a pair.
    batch["pair_key"] = np.array(["" if r else pair_key(s, t, sl, tl) for s, t, sl, tl, r in
                                  zip(batch["src"], batch["tgt"], batch["src_lang"], batch["tgt_lang"], batch["drop_reason"])],
                                 dtype=object)
    batch["group_key"] = group_key(batch["pair_key"], batch["example_id"], seed)
    # Decided on the original source, before directions are expanded: a pair and its reverse always
    # land on the same side of the split.
    batch["is_val"] = np.array([split_key(str(s), seed) < val_fraction for s in batch["src"]], dtype=bool)
    batch["sample"] = np.array(
        [format_sample(o, r, str(s), width=100) if r in BAD_LINE_REASONS else "" for o, r, s in
         zip(batch["origin"], batch["drop_reason"], batch["src"])],
        dtype=object,
    )
    del batch["origin"]
    # Dropped rows are never reversed: they are counted once, as the corpus row they are.
    expanded = expand_directions({k: list(v[keep]) for k, v in batch.items()}, both)
    n_rev = len(expanded["src"]) - int(keep.sum())
    out = {}
    for k, v in batch.items():
        rev = np.asarray(expanded[k][len(expanded[k]) - n_rev:], dtype=v.dtype) if n_rev else v[:0]
        out[k] = np.concatenate([v, rev])
    # Reversed rows share their pair's group_key (same partition) but are deduplicated on their own.
    out["pair_key"][len(keep):] = [k + "|reversed" for k in out["pair_key"][len(keep):]]
    out["direction"] = np.concatenate([np.zeros(len(keep), np.int8), np.ones(n_rev, np.int8)])
    return out


def finish_partition(table: pa.Table, weights: list[float], seed: int, dedup: bool = True) -> pa.Table:
    """One partition of the sort (whole pair groups, Arrow): mark duplicates (``dedup``), apply source
    weights, and put the examples in the seeded ``order_key`` order; returns the :data:`TOKENIZED_COLUMNS`.

    Token columns are only taken by index (Arrow ``take``), never converted to Python objects."""
    eids = table["example_id"].to_numpy()
    reasons = np.array(table["drop_reason"].to_pylist(), dtype=object)
    if dedup:
        reasons = mark_duplicates({"pair_key": np.array(table["pair_key"].to_pylist(), dtype=object), "example_id": eids,
                                   "drop_reason": reasons})["drop_reason"]
    weighted = apply_weights({"example_id": eids, "source": table["source"].to_numpy(), "drop_reason": reasons}, weights, seed)
    direction = table["direction"].to_numpy()[weighted["index"]]
    # example_id and direction break the (astronomically unlikely) ties of order_key: the order never
    # depends on how Ray arranged equal sort keys.
    order = np.lexsort((direction, weighted["example_id"], order_key(weighted["example_id"], direction, seed)))
    out = table.select(["input_ids", "labels", "num_tokens", "num_targets", "is_val", "sample"]).take(weighted["index"][order])
    columns = {
        "example_id": pa.array(weighted["example_id"][order], pa.int64()),
        "drop_reason": pa.array(weighted["drop_reason"][order].tolist(), pa.string()),
        "primary": pa.array((weighted["copy"][order] == 0) & (direction[order] == 0), pa.bool_()),
    }
    return pa.table({name: columns[name] if name in columns else out[name] for name in TOKENIZED_COLUMNS})


def sort_partitions(data: DataConfig, input_bytes: int) -> int:
    """The sort's partition count: ``data.sort_partitions``, or for ``auto`` enough partitions that each
    holds about :data:`PARTITION_BYTES` of tokenized examples, estimated from the corpus files' bytes
    (``.gz`` files count 4×, for their compression), both directions and the largest source weight."""
    if data.sort_partitions != "auto":
        return data.sort_partitions
    grown = (2 if data.both_directions else 1) * max([1.0, *(s.weight for s in data.sources)])
    return max(2, math.ceil(input_bytes * TOKENIZED_BYTES_PER_INPUT_BYTE * grown / PARTITION_BYTES))


def read_pairs(cfg: Config):
    """All configured sources as one Ray Dataset of raw pairs, each read once (weights apply later),
    and the bytes of the files read (``.gz`` counted 4×: about what they hold)."""
    units = [unit for index, source in enumerate(cfg.data.sources) for unit in plan_source(source, index)]
    nbytes = sum(file_size(f) * (4 if f.endswith(".gz") else 1) for unit in units for f in unit.files)
    return read_units(units), nbytes


def tokenized_dataset(cfg: Config):
    """Cleaned, split, tokenized, deduplicated and weighted examples, every row kept (dropped ones carry
    their ``drop_reason``), in the :data:`TOKENIZED_COLUMNS`: one block per sort partition, in the seeded
    order."""
    data = cfg.data
    # A file is read by one task into blocks of up to 128 MiB; smaller blocks let the later stages
    # (and the tokenizer actors) work on one file in parallel.
    pairs, input_bytes = read_pairs(cfg)
    ds = pairs.repartition(target_num_rows_per_block=ROWS_PER_BLOCK)
    ds = ds.map_batches(prepare_pairs, batch_format="numpy", fn_kwargs={
        "rules": cleaning_rules(data), "seed": data.seed, "val_fraction": data.val_fraction, "both": data.both_directions,
    })
    ds = map_on_actors(
        ds, TokenizePairs, data.tokenize_actors,
        fn_constructor_kwargs={
            "tokenizer_name": cfg.model.tokenizer or cfg.model.name_or_path,
            "max_example_tokens": data.max_example_tokens,
            "trust_remote_code": cfg.model.trust_remote_code,
            "family": resolve_family(cfg.model.family, cfg.model.tokenizer or cfg.model.name_or_path),
        },
        batch_size=data.tokenize_batch_size,
        batch_format="numpy",
    ).select_columns(list(SORTED_COLUMNS))
    partitions = sort_partitions(data, input_bytes)
    log.info("data: reading %.1f MB of corpus files, tokenizing on %d actors, sorting into %d partitions",
             input_bytes / 2**20, data.tokenize_actors, partitions)
    ds = ds.sort("group_key", boundaries=uniform_boundaries(partitions))
    weights = [s.weight for s in data.sources]
    return ds.map_batches(finish_partition, batch_size=None, batch_format="pyarrow",
                          fn_kwargs={"weights": weights, "seed": data.seed, "dedup": data.dedup})


def block_stats(table: pa.Table) -> dict:
    """Counts of one block of tokenized examples (Arrow; summed by :func:`merge_stats`): a single cheap
    pass over the materialized examples instead of a groupby and several counts."""
    reasons = np.array(table["drop_reason"].to_pylist(), dtype=object)
    kept = reasons == ""
    is_val = table["is_val"].to_numpy(zero_copy_only=False)
    primary = table["primary"].to_numpy(zero_copy_only=False)
    counted = ~kept & (primary | (reasons == "too_many_tokens"))
    names, counts = np.unique(reasons[counted].astype(str), return_counts=True)
    train = kept & ~is_val
    return {
        "rows_read": int(primary.sum()),
        "dropped": {str(k): int(v) for k, v in zip(names, counts)},
        "train_examples": int(train.sum()),
        "val_examples": int((kept & is_val).sum()),
        "train_tokens": int(table["num_tokens"].to_numpy()[train].sum()),
        "train_target_tokens": int(table["num_targets"].to_numpy()[train].sum()),
        "samples": [x for x in table["sample"].to_pylist() if x][:5],
        "bytes": table.nbytes,
    }


def _all_block_stats(ds) -> list[dict]:
    """:func:`block_stats` of every block of a materialized dataset, in block order: one plain Ray task
    per block, scheduled where the block is (a Ray Data pass would start another execution, seconds of
    fixed cost, for a few counts)."""
    import ray

    remote = ray.remote(block_stats)
    return ray.get([remote.remote(ref) for ref in ds.to_arrow_refs()])


def merge_stats(records: list[dict]) -> tuple[DataStats, list[str]]:
    """Sum the per-block :func:`block_stats` (in block order) into ``DataStats`` and the first bad-line samples."""
    stats, samples = DataStats(), []
    for r in records:
        for key in ("rows_read", "train_examples", "val_examples", "train_tokens", "train_target_tokens"):
            setattr(stats, key, getattr(stats, key) + r[key])
        stats.largest_block_bytes = max(stats.largest_block_bytes, r["bytes"])
        for reason, n in r["dropped"].items():
            stats.dropped[reason] = stats.dropped.get(reason, 0) + n
        samples.extend(r["samples"])
    return stats, samples[:5]


def check_bad_lines(stats: DataStats, samples: list[str], data: DataConfig) -> None:
    """Log how many rows could not be parsed (with examples) and fail above ``data.max_bad_fraction``."""
    n_bad = sum(stats.dropped.get(r, 0) for r in BAD_LINE_REASONS)
    if not n_bad:
        return
    log.warning("%d of %d rows could not be parsed (malformed or invalid UTF-8), e.g.:\n  %s",
                n_bad, stats.rows_read, "\n  ".join(samples))
    check_bad_fraction(n_bad, stats.rows_read, data.max_bad_fraction, samples)


def to_rows(ds, data: DataConfig, limit: int | None = None):
    """Examples (in the seeded order, one block per sort partition) → training rows: packs, or one
    padded example per row; ``limit``: only the first examples of that order.

    Packing takes each partition's block whole, so the packs are the same on every run."""
    if limit is not None:
        ds = ds.limit(limit)
    if data.packing:
        return ds.map_batches(pack_examples, fn_kwargs={"max_tokens": data.pack_tokens}, batch_size=None, batch_format="numpy")
    return ds.map_batches(as_single_rows, batch_size=4096, batch_format="numpy")


def _our_cause(exc: BaseException) -> BaseException | None:
    """The project's own error (bad data, bad config) inside Ray's task-error wrappers, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__module__.startswith("raytrain_hymt.") and not isinstance(exc, RuntimeError):
            return exc
        # RayTaskError keeps the task's exception in .cause; Ray Data chains it with __cause__.
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def _execute(ds):
    """``ds.materialize()``, re-raising a data error from a Ray task as itself (a ``DataSourceError``
    naming the file, not a ``UserCodeException`` around it)."""
    try:
        return ds.materialize()
    except Exception as e:
        cause = _our_cause(e)
        if cause is None:
            raise
        raise cause from None


def lazy_datasets(cfg: Config):
    """The pipeline up to not-yet-executed train and validation row datasets, plus the statistics.

    Executes (and materializes) the tokenized, ordered examples once, to count them; the returned
    datasets pack when consumed. ``stats.train_rows``/``val_rows`` are left for the caller to fill
    (:func:`fill_row_stats`) once the rows exist."""
    import ray.data
    from ray.data.expressions import col

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.raise_original_map_exception = True  # else Ray keeps only the text of our data errors
    data = cfg.data
    started = time.monotonic()
    tokenized = _execute(tokenized_dataset(cfg))
    stats, samples = merge_stats(_all_block_stats(tokenized))
    log.info("data: %d pairs read, %d examples kept and tokenized, in %d sort partitions (%.0f s)", stats.rows_read,
             stats.train_examples + stats.val_examples, tokenized.num_blocks(), time.monotonic() - started)
    stats.val_examples = min(stats.val_examples, data.max_val_examples)
    if stats.rows_read == 0:
        paths = ", ".join(repr(s.path) for s in data.sources)
        raise DataSourceError(f"the data sources ({paths}) hold no rows: the files are empty")
    check_bad_lines(stats, samples, data)
    if stats.train_examples == 0:
        raise ValueError(f"no training examples left after cleaning ({stats.summary()}); check data.* settings")

    keep_cols = ["input_ids", "labels", "example_id"]
    kept = col("drop_reason") == ""
    train_ex = tokenized.filter(expr=kept & (col("is_val") == False)).select_columns(keep_cols)  # noqa: E712
    val_ex = tokenized.filter(expr=kept & (col("is_val") == True)).select_columns(keep_cols)  # noqa: E712
    train = to_rows(train_ex, data)
    val = to_rows(val_ex, data, limit=data.max_val_examples)
    return train, val, stats


def build_datasets(cfg: Config):
    """Run the whole pipeline: ``(train_rows, val_rows, stats)``, both datasets materialized; or, with
    ``data.prepared_path``, stream the rows ``hymt prepare`` wrote (same columns, same order)."""
    if cfg.data.prepared_path:
        from raytrain_hymt.data.prepared import read_prepared

        return read_prepared(cfg)
    train, val, stats = lazy_datasets(cfg)
    started = time.monotonic()
    # Blocks of one lane each (data.blocks): a training rank fetches only the blocks of its own lanes.
    train = train.repartition(target_num_rows_per_block=block_rows(cfg, stats), strict=True).materialize()
    val = val.materialize()
    stats = fill_row_stats(stats, train, val)
    log.info("data: %d training rows and %d validation rows packed (%.0f s)", stats.train_rows, stats.val_rows,
             time.monotonic() - started)
    return train, val, stats


def map_on_actors(ds, fn, size: int, **map_args):
    """``ds.map_batches(fn, **map_args)`` on a fixed pool of ``size`` actors that are never restarted
    (the module docstring says why)."""
    from ray.data import ActorPoolStrategy

    # Ray 2.60.0 takes max_restarts only through map_batches' **ray_remote_args, deprecated there (to go
    # in 2.64) with no named replacement: neither map_batches nor ActorPoolStrategy has one, and
    # ray_remote_args_fn is deprecated alike. tests/integration/test_pipeline.py fails once that changes.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`ray_remote_args` is deprecated")
        return ds.map_batches(fn, compute=ActorPoolStrategy(size=size), max_restarts=0, **map_args)
