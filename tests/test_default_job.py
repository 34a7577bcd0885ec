"""The default job (`make train`: preset tiny-cpu, no overrides) reproduces its recorded step-by-step
losses exactly. ``tests/assets/losses/default_job.json`` was recorded before the #13 refactor and
re-recorded (``python jobs/train.py``, its ``metrics.jsonl``) when each rank began to fetch only its own
lanes of the data (#16), so any change that moves the trajectory (data order, packing, loss
normalisation, schedule) fails here."""

from __future__ import annotations

import json
from pathlib import Path

ASSET = Path(__file__).parent / "assets" / "losses" / "default_job.json"


def test_the_default_job_reproduces_its_recorded_losses(ray_session, tmp_path):
    from raytrain_hymt.config import load_config
    from raytrain_hymt.trainer import run_training

    summary = run_training(load_config(None, [f"run.storage_root={tmp_path}"]))
    records = [json.loads(line) for line in (Path(summary.run_dir) / "metrics.jsonl").read_text().splitlines()]
    metric = lambda key: {r["step"]: r["value"] for r in records if r["kind"] == "metric" and r["key"] == key}  # noqa: E731
    recorded = json.loads(ASSET.read_text())
    train = metric("train/loss")
    assert [train[s] for s in sorted(train)] == recorded["train_loss"]
    assert {str(s): v for s, v in sorted(metric("val/loss").items())} == recorded["val_loss"]
