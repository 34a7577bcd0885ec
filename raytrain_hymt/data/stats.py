"""What the data pipeline read, kept and dropped: the statistics every run logs as ``data.*``."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    largest_block_bytes: int = 0
    """Bytes of the largest block of tokenized examples (one sort partition: what one task holds)."""

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
            "data.largest_block_bytes": self.largest_block_bytes,
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


def fill_row_stats(stats: DataStats, train, val) -> DataStats:
    """Count the rows of materialized train/val datasets into ``stats``."""
    stats.train_rows, stats.val_rows = train.count(), val.count()
    return stats
