"""What tests/integration/test_fault_tolerance.py and its two-node driver (tests/two_node_run.py) share."""

from __future__ import annotations

import json
from pathlib import Path

STEPS = 10
#: Rank 1's loss is NaN at this step in every run: the skipped update is part of the reference trajectory.
NAN_STEP = 3
NAN_FAULT = {"kind": "nan", "rank": 1, "step": NAN_STEP}


def overrides(storage: str, name: str, **extra: object) -> list[str]:
    """``--set`` overrides of a 10-step tiny run checkpointing every 2 steps; numbers match across runs.
    Packed rows of 256 tokens, as conftest.tiny_overrides: a fifth of the preset's step time on a CPU worker."""
    values = {
        "run.storage_root": storage, "run.name": name, "run.export": False, "data.pack_tokens": 256,
        "optim.max_steps": STEPS, "checkpoint.every_steps": 2, "checkpoint.num_to_keep": 4,
        "eval.every_steps": 1000, "tracking.enabled": False,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def read_records(folder: Path, rank: int) -> list[dict]:
    """The per-step lines rank ``rank`` appended (faults.record_step), every attempt in order."""
    return [json.loads(line) for line in Path(folder, f"rank{rank}.jsonl").read_text().splitlines()]


def attempts(records: list[dict]) -> list[list[dict]]:
    """Split a record into attempts: a new attempt starts in a new worker process, or where the step does
    not increase (a worker that resumes right after its last recorded step has a new process all the same)."""
    out: list[list[dict]] = []
    for r in records:
        if not out or r["step"] <= out[-1][-1]["step"] or r["pid"] != out[-1][-1]["pid"]:
            out.append([])
        out[-1].append(r)
    return out


def effective(records: list[dict]) -> dict[int, dict]:
    """Step → the record of the attempt whose result the final model carries (the last one per step)."""
    return {r["step"]: r for r in records}
