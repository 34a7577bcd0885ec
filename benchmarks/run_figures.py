"""A finished run's figures from what its workers wrote, never from console text.

Rank 0 logs every step's metrics (``train/memory_gib``, ``train/memory_reserved_gib``,
``train/tokens_per_s_per_worker``, ``train/mfu``; ``Worker.train_step``) and the export's duration
(``export/seconds``; ``loop.train_loop``) to the run's ``metrics.jsonl`` and MLflow run; the checkpoints,
the exported model and ``summary.json`` lie in the run folder.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

#: The metrics these figures come from (the names ``Worker.train_step`` and ``train_loop`` log).
MEMORY, RESERVED = "train/memory_gib", "train/memory_reserved_gib"
TOKENS_PER_S, MFU, LOSS = "train/tokens_per_s_per_worker", "train/mfu", "train/loss"


def folder_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _steady(points: list[tuple[int, float]]) -> float | None:
    """Median of the steps after the first (which holds compilation and the allocator's warm-up)."""
    values = [v for _, v in points]
    return statistics.median(values[1:] or values) if values else None


def run_figures(storage_root: Path, name: str) -> dict:
    """The figures of run ``name`` under the local ``storage_root``; a figure the run did not report is None.

    Memory is rank 0's, peak so far at each logged step (on a GPU ``max_memory_allocated`` and
    ``max_memory_reserved``; on a CPU the worker's resident size, and no reserved figure). MFU is None where
    the device's peak FLOP/s is unknown (every CPU)."""
    from raytrain_hymt.driver.plot import read_run
    from raytrain_hymt.errors import ConfigError
    from raytrain_hymt.storage import SUMMARY_FILE
    from raytrain_hymt.train.loop import EXPORT_SECONDS
    from raytrain_hymt.train.worker import MODEL_DIR

    try:
        series = read_run(str(storage_root), name)
    except ConfigError:  # the run failed before rank 0 logged a step: every metric figure is None
        series = {}
    run = storage_root / name

    def last(key: str) -> float | None:
        return series[key][-1][1] if key in series else None

    def peak(key: str) -> float | None:
        return max(v for _, v in series[key]) if key in series else None

    checkpoints = sorted(run.glob("checkpoint_step*"))
    summary_path = run / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {
        "steps_logged": len(series.get(LOSS, [])),
        "steps_done": summary.get("steps"),
        "train_loss": summary.get("train_loss"),
        "max_memory_allocated_gib": peak(MEMORY),
        "max_memory_reserved_gib": peak(RESERVED),
        "tokens_per_s_per_gpu_last": last(TOKENS_PER_S),
        "tokens_per_s_per_gpu_median": _steady(series.get(TOKENS_PER_S, [])),
        "mfu_last": last(MFU),
        "mfu_median": _steady(series.get(MFU, [])),
        "export_s": last(EXPORT_SECONDS),
        "checkpoint_bytes": folder_bytes(checkpoints[-1]) if checkpoints else None,
        "export_bytes": folder_bytes(run / MODEL_DIR) if (run / MODEL_DIR).exists() else None,
    }
