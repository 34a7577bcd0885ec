"""The default job (`make train`: preset tiny-cpu, no overrides) reproduces its recorded step-by-step
losses exactly. ``tests/assets/losses/default_job.json`` was recorded before the #13 refactor and
re-recorded (``python jobs/train.py``, its ``metrics.jsonl``) when each rank began to fetch only its own
lanes of the data (#16), so any change that moves the trajectory (data order, packing, loss
normalisation, schedule) fails here.

Float kernels round differently on another CPU (an Intel Xeon's matched that AMD EPYC recording for two
steps, then differed by up to 5e-4 relative), so each recording names the CPU vendor it was made on and
the job must match its own CPU's exactly. On a CPU with no recording of its own the job must come within
2e-3 relative of each recording: a changed data order or loss moves it by far more than that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: ``{CPU vendor: recording}``, each recording naming its CPU under ``cpu``.
RECORDINGS = {(r := json.loads(p.read_text()))["cpu"].split()[0]: r
              for p in (Path(__file__).parent / "assets" / "losses").glob("default_job*.json")}
#: Between the recordings of two CPUs: at most 5e-4 relative over the 60 steps.
OTHER_CPU_RTOL = 2e-3


def cpu_vendor() -> str:
    """The CPU's vendor as the kernel reports it (``GenuineIntel``, ``AuthenticAMD``), or ``unknown``."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def test_the_recordings_are_of_two_cpus_and_close():
    assert sorted(RECORDINGS) == ["AuthenticAMD", "GenuineIntel"]
    amd, intel = RECORDINGS["AuthenticAMD"], RECORDINGS["GenuineIntel"]
    assert amd["train_loss"][:2] == intel["train_loss"][:2] and amd["train_loss"] != intel["train_loss"]
    assert intel["train_loss"] == pytest.approx(amd["train_loss"], rel=OTHER_CPU_RTOL)


def test_the_default_job_reproduces_its_recorded_losses(ray_session, tmp_path):
    from raytrain_hymt.config import load_config
    from raytrain_hymt.trainer import run_training

    summary = run_training(load_config(None, [f"run.storage_root={tmp_path}"]))
    records = [json.loads(line) for line in (Path(summary.run_dir) / "metrics.jsonl").read_text().splitlines()]
    metric = lambda key: {r["step"]: r["value"] for r in records if r["kind"] == "metric" and r["key"] == key}  # noqa: E731
    train = metric("train/loss")
    train = [train[s] for s in sorted(train)]
    val = {str(s): v for s, v in sorted(metric("val/loss").items())}
    own = RECORDINGS.get(cpu_vendor())
    if own:
        assert train == own["train_loss"], f"recorded on {own['cpu']}"
        assert val == own["val_loss"]
        return
    for recorded in RECORDINGS.values():  # no recording of this CPU: near each
        assert train == pytest.approx(recorded["train_loss"], rel=OTHER_CPU_RTOL), f"{cpu_vendor()} vs {recorded['cpu']}"
        assert val == pytest.approx(recorded["val_loss"], rel=OTHER_CPU_RTOL)
