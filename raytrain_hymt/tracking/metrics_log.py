"""The local copy of everything a tracker logs, whatever MLflow does: ``metrics.jsonl`` and TensorBoard.

``metrics.jsonl`` holds one JSON object a line (``kind``: metric or param, ``step``, ``key``, ``value``,
``time``). The tracker reads it back to send the metrics of earlier attempts that MLflow lacks, and
``hymt plot`` draws from it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from raytrain_hymt.storage import METRICS_FILE

TENSORBOARD_DIR = "tensorboard"


def read_metrics(path: Path, end: int | None = None) -> Iterator[tuple[str, float, int, float]]:
    """``(key, value, step, time)`` of the metric lines in the first ``end`` bytes of ``path`` (all: None).

    A line cut off by a crash mid-write is skipped.
    """
    if not path.is_file():
        return
    with open(path, "rb") as f:
        data = f.read(-1 if end is None else end)
    for line in data.decode("utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "metric" and rec.get("step") is not None:
            yield rec["key"], rec["value"], rec["step"], rec.get("time", 0.0)


class MetricsLog:
    """Append-only ``<folder>/metrics.jsonl``, and TensorBoard scalars in ``<folder>/tensorboard`` when asked."""

    def __init__(self, folder: Path, tensorboard: bool = False):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / METRICS_FILE
        self.size_at_open = self.path.stat().st_size if self.path.exists() else 0
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the whole run
        self._tb = _tensorboard_writer(folder / TENSORBOARD_DIR) if tensorboard else None

    def write(self, kind: str, items: list[tuple[str, Any, int | None]], when: float) -> None:
        """One JSON line per (key, value, step), flushed so that a crash loses nothing; metrics also to TensorBoard.

        Nothing once closed: what a job logs after its tracker finished is ignored.
        """
        if self._file.closed:
            return
        for key, value, step in items:
            line = {"kind": kind, "step": step, "key": key, "value": value, "time": when}
            self._file.write(json.dumps(line, default=str) + "\n")
            if kind == "metric" and self._tb is not None:
                self._tb.add_scalar(key, value, step)
        self._file.flush()

    def close(self) -> None:
        """Close the files."""
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def _tensorboard_writer(log_dir: Path):
    """A ``torch.utils.tensorboard.SummaryWriter``; a clear error when ``tensorboard`` is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "tracking.tensorboard=True needs the 'tensorboard' package (torch's SummaryWriter uses it): "
            "pip install tensorboard"
        )
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


def read_params(path: Path) -> dict[str, str]:
    """The params ``path`` holds, each key's first value (MLflow keeps the first; a resumed job logs them again)."""
    params: dict[str, str] = {}
    if not path.is_file():
        return params
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind") == "param":
            params.setdefault(rec["key"], str(rec["value"]))
    return params
