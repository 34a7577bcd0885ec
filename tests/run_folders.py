"""Run folders written by hand, as a run leaves them: its ``config.yaml`` and ``summary.json``, and
checkpoint folders whose state and markers are real but whose shards are stand-in files (the checks before
Ray starts read only the listing, ``state.json`` and the markers)."""

from __future__ import annotations

import json
from pathlib import Path

from raytrain_hymt.config.schema import load_config, to_yaml
from raytrain_hymt.storage import SUMMARY_FILE, RunFolder


def run_config(storage: Path, *sets: str, name: str | None = "new"):
    """The config of run ``name`` under ``storage``, 20 steps, with ``sets`` applied."""
    return load_config(None, [f"run.storage_root={storage}", "optim.max_steps=20", *sets]
                       + ([f"run.name={name}"] if name else []))


def finished_run(storage: Path, name: str = "e2e", steps: int = 20, *sets: str) -> RunFolder:
    """A run folder as a finished run leaves it: its config and its summary."""
    folder = RunFolder(str(storage), name)
    folder.write_text("config.yaml", to_yaml(run_config(storage, *sets, name=name)))
    folder.write_text(SUMMARY_FILE, json.dumps({
        "name": name, "run_dir": folder.uri, "checkpoint": f"{folder.uri}/checkpoint_step{steps:08d}", "model_dir": None,
        "steps": steps, "train_loss": 1.0, "val_loss": None, "wall_time_s": 1.0, "tracking_uri": None,
        "mlflow_run_id": None, "mlflow_experiment": None}))
    return folder


def whole_checkpoint(run: Path, step: int, world: int = 2, base_model: dict | None = None) -> Path:
    """A whole checkpoint of ``step``: state, one stand-in shard per rank, every rank's marker."""
    folder = run / f"checkpoint_step{step:08d}"
    (folder / "complete").mkdir(parents=True)
    state = {"step": step, "epoch": 0, "batch_in_epoch": step, "world_size": world, "tag": f"step{step:08d}",
             "zero_stage": 2, "base_model": base_model}
    (folder / "state.json").write_text(json.dumps(state))
    for rank in range(world):
        (folder / f"shard{rank}.pt").write_bytes(b"x" * 10)
        files = {f"shard{rank}.pt": 10, **({"state.json": (folder / "state.json").stat().st_size} if rank == 0 else {})}
        (folder / "complete" / f"rank{rank}").write_text(json.dumps({"files": files}))
    return folder


def cut_off_checkpoint(folder: Path, step: int = 4) -> Path:
    """A checkpoint of 2 ranks whose rank 1 never wrote its marker (as a kill mid-save leaves it)."""
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 2,
                                                   "tag": f"step{step:08d}", "zero_stage": 2}))
    (folder / "complete").mkdir()
    (folder / "complete" / "rank0").write_text(json.dumps({"files": {}}))
    return folder
