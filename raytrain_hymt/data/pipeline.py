"""The Ray Data pipeline: readers → cleaning → dedup → weights → split → prompts + tokenize (actor pool)
→ order → pack.

The result is two datasets of training rows in a fixed order (same seed, same rows, same order on every
run and worker count) plus the statistics of what was kept and dropped. Each training worker reads the
whole ordered stream and takes its own slice of every global batch (``train_loop.rank_slice``), which
makes batches independent of the worker count and lets a restarted run skip exactly the rows it already
trained on.

Determinism: every per-row decision is a hash of the row (split: the source sentence; order: the seeded
``order_key``; weights: the ``example_id``), the dedup keeps the smallest ``example_id`` of each pair, and
the two sorts use fixed partition boundaries, so even the block layout that packing sees is the same on
every run (Ray's sort samples its boundaries at random when none are given).

``build_datasets`` materializes its results (each training worker then reads the object store, not the
pipeline again). For corpora larger than the cluster's object store, ``hymt prepare`` writes the rows to
Parquet once (:mod:`raytrain_hymt.data.prepare`) and ``data.prepared_path`` streams them from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field

import numpy as np

from raytrain_hymt.config import Config, DataConfig
from raytrain_hymt.data.cleaning import CleaningRules, check_bad_fraction, clean_batch, format_sample, pair_key, split_key
from raytrain_hymt.data.packing import IGNORE_INDEX, as_single_rows, pack_examples
from raytrain_hymt.data.prompts import expand_directions
from raytrain_hymt.data.readers import DataSourceError, read_source
from raytrain_hymt.data.tokenize import TokenizePairs

log = logging.getLogger(__name__)

BAD_LINE_REASONS = ("malformed", "invalid_utf8")
#: Rows per block between reading and tokenizing (the unit of parallel work).
ROWS_PER_BLOCK = 16384
#: Partitions of the dedup sort: each holds ~1/16 of the corpus in one block (grow it for corpora
#: whose sixteenth does not fit a worker's memory).
DEDUP_PARTITIONS = 16
#: Examples per partition of the ordering sort (packs never span partitions: one part-filled row each).
EXAMPLES_PER_PARTITION = 65536
#: Columns of the materialized tokenized dataset (texts are gone; bad rows keep a short ``sample``).
TOKENIZED_COLUMNS = ("input_ids", "labels", "example_id", "direction", "num_tokens", "num_targets",
                     "order_key", "drop_reason", "is_val", "primary", "sample")


@dataclass
class DataStats:
    """What the pipeline read, kept and dropped (logged to MLflow as ``data.*``).

    ``rows_read`` and every drop reason but ``too_many_tokens`` count corpus rows (each read once);
    ``too_many_tokens`` and the ``*_examples`` count examples, i.e. after source weights and
    ``both_directions`` multiplied them.
    """

    rows_read: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    train_examples: int = 0
    val_examples: int = 0
    train_rows: int = 0
    val_rows: int = 0
    train_tokens: int = 0
    train_target_tokens: int = 0

    def as_metrics(self) -> dict[str, float]:
        """Flat ``data.*`` numbers for MLflow."""
        out = {
            "data.rows_read": self.rows_read,
            "data.train_examples": self.train_examples,
            "data.val_examples": self.val_examples,
            "data.train_rows": self.train_rows,
            "data.val_rows": self.val_rows,
            "data.train_tokens": self.train_tokens,
            "data.train_target_tokens": self.train_target_tokens,
        }
        out.update({f"data.dropped.{k}": v for k, v in sorted(self.dropped.items())})
        return {k: float(v) for k, v in out.items()}

    def summary(self) -> str:
        """One line for the console."""
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(self.dropped.items()) if v) or "none"
        return (
            f"data: read {self.rows_read} pairs; dropped {dropped}; train {self.train_examples} examples "
            f"in {self.train_rows} rows ({self.train_tokens} tokens), validation {self.val_examples} examples"
        )


def cleaning_rules(data: DataConfig) -> CleaningRules:
    """The pure cleaning rules from the data config."""
    return CleaningRules(
        min_chars=data.min_chars,
        max_chars=data.max_chars,
        max_length_ratio=data.max_length_ratio,
        drop_identical=data.drop_identical,
        on_unsupported_language=data.on_unsupported_language,
    )


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def order_key(example_ids: np.ndarray, directions: np.ndarray, seed: int) -> np.ndarray:
    """Seeded pseudo-random sort key per example: a shuffle that is the same on every machine."""
    return np.array([_hash64(f"{seed}|{int(e)}|{int(d)}") for e, d in zip(example_ids, directions)], dtype=np.int64)


def uniform_boundaries(partitions: int) -> list[int]:
    """Boundaries splitting the int64 range into equal partitions (for uniform hash keys); at least
    two partitions, because Ray treats an empty list as "sample boundaries at random"."""
    edges = np.linspace(np.iinfo(np.int64).min, np.iinfo(np.int64).max, max(2, partitions) + 1, dtype=np.float64)[1:-1]
    return [int(e) for e in edges]


def sort_boundaries(n_rows: int) -> list[int]:
    """Fixed boundaries of the ordering sort on the seeded ``order_key`` (:data:`EXAMPLES_PER_PARTITION`)."""
    return uniform_boundaries(-(-n_rows // EXAMPLES_PER_PARTITION))


def _add_pair_key(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # Dropped rows get no key: they never count as the "first" copy of a pair.
    keys = ["" if r else pair_key(s, t, sl, tl) for s, t, sl, tl, r in
            zip(batch["src"], batch["tgt"], batch["src_lang"], batch["tgt_lang"], batch["drop_reason"])]
    batch["pair_key"] = np.array(keys, dtype=object)
    # The sort needs a number (Ray's fixed boundaries are numeric): the key's first 64 bits; dropped rows
    # spread by their id.
    batch["pair_bucket"] = np.array(
        [int.from_bytes(bytes.fromhex(k[:16]), "big", signed=True) if k else int(e) for k, e in zip(keys, batch["example_id"])],
        dtype=np.int64,
    )
    return batch


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


def dedup(ds):
    """Exact-duplicate removal that scales past one machine: Ray's distributed sort brings equal
    ``pair_key`` values into one block (the same guarantee ``groupby().map_groups`` relies on), and
    :func:`mark_duplicates` keeps the smallest ``example_id`` per key. The sort's boundaries are fixed
    (:data:`DEDUP_PARTITIONS` ranges of the key's hash), so the work spreads over that many reduce tasks."""
    ds = ds.map_batches(_add_pair_key, batch_format="numpy")
    ds = ds.sort("pair_bucket", boundaries=uniform_boundaries(DEDUP_PARTITIONS))
    ds = ds.map_batches(mark_duplicates, batch_size=None, batch_format="numpy").drop_columns(["pair_key", "pair_bucket"])
    return ds.repartition(target_num_rows_per_block=ROWS_PER_BLOCK)


def apply_weights(batch: dict[str, np.ndarray], weights: list[float], seed: int) -> dict[str, np.ndarray]:
    """Repeat or subsample kept rows by their source's weight (``2.5``: twice, plus a third copy for half
    the rows). Which rows get the fractional copy is a seeded hash of the ``example_id`` (deterministic);
    a row sampled away is marked ``subsampled``; copy ``k > 0`` gets a new ``example_id`` derived from
    the original. Adds ``copy`` (0 for the original). Dropped rows stay as one row, to be counted."""
    n = len(batch["src"])
    index: list[int] = []
    copies: list[int] = []
    reasons = list(batch["drop_reason"])
    for i in range(n):
        w = weights[int(batch["source"][i])]
        whole, frac = int(w), w - int(w)
        u = (_hash64(f"{seed}|weight|{int(batch['example_id'][i])}") / 2**64) + 0.5
        count = whole + (u < frac)
        if reasons[i] or count <= 1:
            index.append(i)
            copies.append(0)
            reasons[i] = reasons[i] or ("subsampled" if count == 0 else "")
        else:
            index.extend([i] * count)
            copies.extend(range(count))
    out = {k: np.asarray(v)[index] for k, v in batch.items()}
    out["drop_reason"] = np.array(reasons, dtype=object)[index]
    out["copy"] = np.array(copies, dtype=np.int32)
    out["example_id"] = np.array(
        [e if c == 0 else _hash64(f"{int(e)}|copy|{c}") for e, c in zip(out["example_id"], copies)], dtype=np.int64
    )
    return out


def _mark_split(batch: dict[str, np.ndarray], seed: int, val_fraction: float) -> dict[str, np.ndarray]:
    # Decided on the original source, before directions are expanded: a pair and its reverse always
    # land on the same side of the split.
    batch["is_val"] = np.array([split_key(str(s), seed) < val_fraction for s in batch["src"]], dtype=bool)
    return batch


def _add_directions(batch: dict[str, np.ndarray], both: bool, seed: int) -> dict[str, np.ndarray]:
    # Dropped rows are never reversed: they are counted once, as the corpus row they are.
    kept = np.array([not r for r in batch["drop_reason"]], dtype=bool)
    expanded = expand_directions({k: list(v[kept]) for k, v in batch.items()}, both)
    n_rev = len(expanded["src"]) - int(kept.sum())
    out = {}
    for k, v in batch.items():
        rev = np.asarray(expanded[k][len(expanded[k]) - n_rev:], dtype=v.dtype) if n_rev else v[:0]
        out[k] = np.concatenate([v, rev])
    out["direction"] = np.concatenate([np.zeros(len(kept), np.int8), np.ones(n_rev, np.int8)])
    out["order_key"] = order_key(out["example_id"], out["direction"], seed)
    return out


def _project(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keep what the later stages need: tokens and bookkeeping, plus a short sample of each bad line."""
    batch["primary"] = (np.asarray(batch["copy"]) == 0) & (np.asarray(batch["direction"]) == 0)
    # Every label that is not -100 is a target; a row's first label is always the prompt's first token.
    batch["num_targets"] = np.array([int((np.asarray(x) != IGNORE_INDEX).sum()) for x in batch["labels"]], dtype=np.int64)
    batch["sample"] = np.array(
        [format_sample(o, r, str(s), width=100) if r in BAD_LINE_REASONS else "" for o, r, s in
         zip(batch["origin"], batch["drop_reason"], batch["src"])],
        dtype=object,
    )
    return {k: batch[k] for k in TOKENIZED_COLUMNS}


def read_pairs(cfg: Config):
    """All configured sources as one Ray Dataset of raw pairs, each read once (weights apply later)."""
    parts = [read_source(source, index) for index, source in enumerate(cfg.data.sources)]
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def cleaned_pairs(cfg: Config):
    """Pairs after cleaning, dedup (``data.dedup``) and source weights; dropped rows kept with a reason."""
    data = cfg.data
    # A file is read by one task into blocks of up to 128 MiB; smaller blocks let the later stages
    # (and the tokenizer actors) work on one file in parallel.
    ds = read_pairs(cfg).repartition(target_num_rows_per_block=ROWS_PER_BLOCK)
    ds = ds.map_batches(clean_batch, fn_kwargs={"rules": cleaning_rules(data)}, batch_format="numpy")
    if data.dedup:
        ds = dedup(ds)
    weights = [s.weight for s in data.sources]
    return ds.map_batches(apply_weights, fn_kwargs={"weights": weights, "seed": data.seed}, batch_format="numpy")


def tokenized_dataset(cfg: Config):
    """Cleaned, split and tokenized examples, every row kept (dropped ones carry their ``drop_reason``),
    in the :data:`TOKENIZED_COLUMNS`."""
    data = cfg.data
    ds = cleaned_pairs(cfg)
    ds = ds.map_batches(_mark_split, fn_kwargs={"seed": data.seed, "val_fraction": data.val_fraction}, batch_format="numpy")
    ds = ds.map_batches(_add_directions, fn_kwargs={"both": data.both_directions, "seed": data.seed}, batch_format="numpy")
    ds = ds.map_batches(
        TokenizePairs,
        fn_constructor_kwargs={
            "tokenizer_name": cfg.model.tokenizer or cfg.model.name_or_path,
            "max_example_tokens": data.max_example_tokens,
            "trust_remote_code": cfg.model.trust_remote_code,
        },
        batch_size=data.tokenize_batch_size,
        batch_format="numpy",
        compute=ray_actor_pool(data.tokenize_actors),
    )
    return ds.map_batches(_project, batch_format="numpy")


def ray_actor_pool(size: int):
    """A fixed-size actor pool strategy for ``map_batches``."""
    from ray.data import ActorPoolStrategy

    return ActorPoolStrategy(size=size)


def block_stats(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Counts of one block of tokenized examples, as one JSON row (summed by :func:`merge_stats`): a
    single cheap pass over the materialized examples instead of a groupby and several counts."""
    reasons = np.asarray(batch["drop_reason"], dtype=object)
    kept = reasons == ""
    is_val = np.asarray(batch["is_val"], dtype=bool)
    counted = ~kept & (np.asarray(batch["primary"], dtype=bool) | (reasons == "too_many_tokens"))
    names, counts = np.unique(reasons[counted].astype(str), return_counts=True)
    train = kept & ~is_val
    samples = [str(x) for x in batch["sample"] if x][:5]
    record = {
        "rows_read": int(np.sum(batch["primary"])),
        "dropped": {str(k): int(v) for k, v in zip(names, counts)},
        "train_examples": int(train.sum()),
        "val_examples": int((kept & is_val).sum()),
        "train_tokens": int(np.asarray(batch["num_tokens"])[train].sum()),
        "train_target_tokens": int(np.asarray(batch["num_targets"])[train].sum()),
        "samples": samples,
    }
    return {"stats": np.array([json.dumps(record)], dtype=object)}


def merge_stats(records: list[dict]) -> tuple[DataStats, list[str]]:
    """Sum the per-block :func:`block_stats` (in block order) into ``DataStats`` and the first bad-line samples."""
    stats, samples = DataStats(), []
    for r in records:
        for key in ("rows_read", "train_examples", "val_examples", "train_tokens", "train_target_tokens"):
            setattr(stats, key, getattr(stats, key) + r[key])
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


def to_rows(ds, data: DataConfig, n_examples: int, limit: int | None = None):
    """Examples → training rows (packs, or one padded example per row), in the seeded order; ``limit``:
    only the first examples of that order.

    The sort has fixed boundaries (:func:`sort_boundaries`) and packing takes each sorted partition
    whole, so the packs are the same on every run."""
    ds = ds.sort("order_key", boundaries=sort_boundaries(n_examples))
    if limit is not None:
        ds = ds.limit(limit)
    ds = ds.drop_columns(["order_key"])
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

    Executes (and materializes) the tokenized examples once, to count them; the returned datasets
    sort and pack when consumed. ``stats.train_rows``/``val_rows`` are left for the caller to fill
    (:func:`fill_row_stats`) once the rows exist."""
    import ray.data
    from ray.data.expressions import col

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.raise_original_map_exception = True  # else Ray keeps only the text of our data errors
    data = cfg.data
    tokenized = _execute(tokenized_dataset(cfg))
    per_block = tokenized.map_batches(block_stats, batch_size=None, batch_format="numpy").take_all()
    stats, samples = merge_stats([json.loads(r["stats"]) for r in per_block])
    stats.val_examples, n_val = min(stats.val_examples, data.max_val_examples), stats.val_examples
    if stats.rows_read == 0:
        paths = ", ".join(repr(s.path) for s in data.sources)
        raise DataSourceError(f"the data sources ({paths}) hold no rows: the files are empty")
    check_bad_lines(stats, samples, data)
    if stats.train_examples == 0:
        raise ValueError(f"no training examples left after cleaning ({stats.summary()}); check data.* settings")

    keep_cols = ["input_ids", "labels", "example_id", "order_key"]
    kept = col("drop_reason") == ""
    train_ex = tokenized.filter(expr=kept & (col("is_val") == False)).select_columns(keep_cols)  # noqa: E712
    val_ex = tokenized.filter(expr=kept & (col("is_val") == True)).select_columns(keep_cols)  # noqa: E712
    train = to_rows(train_ex, data, stats.train_examples)
    val = to_rows(val_ex, data, n_val, limit=data.max_val_examples)
    return train, val, stats


def fill_row_stats(stats: DataStats, train, val) -> DataStats:
    """Count the rows of executed (materialized, or written) train/val datasets into ``stats``."""
    stats.train_rows, stats.val_rows = train.count(), val.count()
    return stats


def build_datasets(cfg: Config):
    """Run the whole pipeline: ``(train_rows, val_rows, stats)``, both datasets materialized; or, with
    ``data.prepared_path``, stream the rows ``hymt prepare`` wrote (same columns, same order)."""
    if cfg.data.prepared_path:
        from raytrain_hymt.data.prepare import read_prepared

        return read_prepared(cfg)
    train, val, stats = lazy_datasets(cfg)
    train, val = train.materialize(), val.materialize()
    return train, val, fill_row_stats(stats, train, val)
