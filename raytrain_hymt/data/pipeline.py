"""The Ray Data pipeline: readers → cleaning → prompts + tokenize (actor pool) → split → order → pack.

The result is two materialized datasets of training rows in a fixed order (same seed, same rows, same
order on every run and worker count) plus the statistics of what was kept and dropped. Each training
worker reads the whole ordered stream and takes its own slice of every global batch
(``train_loop.rank_slice``), which makes batches independent of the worker count and lets a restarted
run skip exactly the rows it already trained on.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import numpy as np

from raytrain_hymt.config import Config, DataConfig
from raytrain_hymt.data.cleaning import CleaningRules, check_bad_fraction, clean_batch, split_key
from raytrain_hymt.data.packing import as_single_rows, pack_examples
from raytrain_hymt.data.prompts import expand_directions
from raytrain_hymt.data.readers import read_source
from raytrain_hymt.data.tokenize import TokenizePairs

log = logging.getLogger(__name__)

BAD_LINE_REASONS = ("malformed", "invalid_utf8")


@dataclass
class DataStats:
    """What the pipeline read, kept and dropped (logged to MLflow as ``data.*``)."""

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


def order_key(example_ids: np.ndarray, directions: np.ndarray, seed: int) -> np.ndarray:
    """Seeded pseudo-random sort key per example: a shuffle that is the same on every machine."""
    keys = np.empty(len(example_ids), dtype=np.int64)
    for i, (eid, d) in enumerate(zip(example_ids, directions)):
        digest = hashlib.blake2b(f"{seed}|{int(eid)}|{int(d)}".encode(), digest_size=8).digest()
        keys[i] = int.from_bytes(digest, "little", signed=True)
    return keys


def _mark_split(batch: dict[str, np.ndarray], seed: int, val_fraction: float) -> dict[str, np.ndarray]:
    # Decided on the original source, before directions are expanded: a pair and its reverse always
    # land on the same side of the split.
    batch["is_val"] = np.array([split_key(str(s), seed) < val_fraction for s in batch["src"]], dtype=bool)
    return batch


def _add_directions(batch: dict[str, np.ndarray], both: bool, seed: int) -> dict[str, np.ndarray]:
    expanded = expand_directions({k: list(v) for k, v in batch.items()}, both)
    out = {k: np.asarray(v, dtype=batch[k].dtype if k in batch else np.int8) for k, v in expanded.items()}
    out["order_key"] = order_key(out["example_id"], out["direction"], seed)
    return out


def read_pairs(cfg: Config):
    """All configured sources as one Ray Dataset of raw pairs (weights > 1 repeat, < 1 subsample)."""
    import ray.data

    parts = []
    for index, source in enumerate(cfg.data.sources):
        ds = read_source(source, index)
        whole, frac = int(source.weight), source.weight - int(source.weight)
        copies = [ds] * whole
        if frac > 0:
            copies.append(ds.random_sample(frac, seed=cfg.data.seed + index))
        parts.extend(copies)
    return parts[0] if len(parts) == 1 else parts[0].union(*parts[1:])


def tokenized_dataset(cfg: Config):
    """Cleaned, split and tokenized pairs, every row kept (dropped ones carry their ``drop_reason``)."""
    data = cfg.data
    ds = read_pairs(cfg)
    ds = ds.map_batches(clean_batch, fn_kwargs={"rules": cleaning_rules(data)}, batch_format="numpy")
    ds = ds.map_batches(_mark_split, fn_kwargs={"seed": data.seed, "val_fraction": data.val_fraction}, batch_format="numpy")
    ds = ds.map_batches(_add_directions, fn_kwargs={"both": data.both_directions, "seed": data.seed}, batch_format="numpy")
    return ds.map_batches(
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


def ray_actor_pool(size: int):
    """A fixed-size actor pool strategy for ``map_batches``."""
    from ray.data import ActorPoolStrategy

    return ActorPoolStrategy(size=size)


def _count(ds, column: str) -> dict[str, int]:
    return {str(r[column]): int(r["count()"]) for r in ds.groupby(column).count().take_all()}


def to_rows(ds, data: DataConfig, *, sort: bool):
    """Examples → training rows (packs, or one padded example per row), in a fixed order."""
    if sort:
        ds = ds.sort("order_key")
    ds = ds.drop_columns(["order_key"]) if "order_key" in ds.columns() else ds
    if data.packing:
        return ds.map_batches(pack_examples, fn_kwargs={"max_tokens": data.pack_tokens}, batch_size=4096, batch_format="numpy")
    return ds.map_batches(as_single_rows, batch_size=4096, batch_format="numpy")


def build_datasets(cfg: Config):
    """Run the whole pipeline: ``(train_rows, val_rows, stats)``, both datasets materialized."""
    import ray.data
    from ray.data.expressions import col

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    data = cfg.data
    tokenized = tokenized_dataset(cfg).materialize()
    reasons = _count(tokenized, "drop_reason")
    stats = DataStats(rows_read=sum(reasons.values()), dropped={k: v for k, v in reasons.items() if k})
    samples = [
        f"{r['origin']}: {r['drop_reason']}: {str(r['src'])[:60]!r}"
        for r in tokenized.filter(lambda r: r["drop_reason"] in BAD_LINE_REASONS).take(5)
    ] if any(stats.dropped.get(r) for r in BAD_LINE_REASONS) else []
    check_bad_fraction(sum(stats.dropped.get(r, 0) for r in BAD_LINE_REASONS), stats.rows_read, data.max_bad_fraction, samples)

    keep_cols = ["input_ids", "labels", "example_id", "direction", "num_tokens", "order_key"]
    kept = col("drop_reason") == ""
    train_ex = tokenized.filter(expr=kept & (col("is_val") == False)).select_columns(keep_cols)  # noqa: E712
    val_ex = tokenized.filter(expr=kept & (col("is_val") == True)).select_columns(keep_cols)  # noqa: E712
    stats.train_examples = train_ex.count()
    if stats.train_examples == 0:
        raise ValueError(f"no training examples left after cleaning ({stats.summary()}); check data.* settings")
    val_ex = val_ex.sort("order_key").limit(data.max_val_examples)
    train = to_rows(train_ex, data, sort=True).materialize()
    val = to_rows(val_ex, data, sort=False).materialize()
    stats.val_examples = val_ex.count()
    stats.train_rows, stats.val_rows = train.count(), val.count()
    stats.train_tokens = int(train_ex.sum("num_tokens"))
    stats.train_target_tokens = int(train.sum("num_target_tokens")) if stats.train_rows else 0
    return train, val, stats
