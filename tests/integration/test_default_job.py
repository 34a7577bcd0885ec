"""The default job (`make train`: preset tiny-cpu, no overrides) reproduces its recorded step-by-step
losses exactly. ``tests/assets/losses/default_job.json`` was recorded before the #13 refactor and
re-recorded (``python jobs/train.py``, its ``metrics.jsonl``) when each rank began to fetch only its own
lanes of the data (#16), so any change that moves the trajectory (data order, packing, loss
normalisation, schedule) fails here.

Float kernels round differently on another kind of CPU (an Intel Xeon's matched the first AMD EPYC
recording for two steps, then differed by up to 5e-4 relative; so did an AMD EPYC without AVX-512), so each
recording names the kernels it was made with, ``kernels``: the CPU vendor and the instruction set torch
dispatches to (``torch.backends.cpu.get_cpu_capability()``), and the job must match its own kind's
recording exactly. On a kind with no recording of its own the job must come within 2e-3 relative of each
recording: a changed data order or loss moves it by far more than that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: ``{kernels: recording}``, each recording naming its kernels (``cpu_kernels()``) and its CPU under ``cpu``.
RECORDINGS = {(r := json.loads(p.read_text()))["kernels"]: r
              for p in (Path(__file__).parents[1] / "assets" / "losses").glob("default_job*.json")}
#: Between the recordings of two kinds of CPU: at most 5e-4 relative over the 60 steps.
OTHER_CPU_RTOL = 2e-3


def cpu_kernels() -> str:
    """The CPU's vendor as the kernel reports it (``GenuineIntel``, ``AuthenticAMD`` or ``unknown``) and the
    instruction set torch's CPU kernels use here (``AVX512``, ``AVX2``, ...), e.g. ``AuthenticAMD AVX2``."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    vendor = next((line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
                   if line.startswith("vendor_id")), "unknown")
    return f"{vendor} {torch.backends.cpu.get_cpu_capability()}"


def test_the_recordings_are_of_three_kinds_of_cpu_and_close():
    assert sorted(RECORDINGS) == ["AuthenticAMD AVX2", "AuthenticAMD AVX512", "GenuineIntel AVX512"]
    first, *others = RECORDINGS.values()
    for other in others:  # the same first steps; then each kind rounds its own way, staying close
        assert other["train_loss"][:2] == first["train_loss"][:2] and other["train_loss"] != first["train_loss"]
        assert other["train_loss"] == pytest.approx(first["train_loss"], rel=OTHER_CPU_RTOL)


def test_the_default_job_reproduces_its_recorded_losses(ray_session, tmp_path):
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.driver.train import run_training

    summary = run_training(load_config(None, [f"run.storage_root={tmp_path}"]))
    records = [json.loads(line) for line in (Path(summary.run_dir) / "metrics.jsonl").read_text().splitlines()]
    metric = lambda key: {r["step"]: r["value"] for r in records if r["kind"] == "metric" and r["key"] == key}  # noqa: E731
    train = metric("train/loss")
    train = [train[s] for s in sorted(train)]
    val = {str(s): v for s, v in sorted(metric("val/loss").items())}
    own = RECORDINGS.get(cpu_kernels())
    if own:
        assert train == own["train_loss"], f"recorded on {own['cpu']}"
        assert val == own["val_loss"]
        return
    for recorded in RECORDINGS.values():  # no recording of this CPU: near each
        assert train == pytest.approx(recorded["train_loss"], rel=OTHER_CPU_RTOL), f"{cpu_kernels()} vs {recorded['cpu']}"
        assert val == pytest.approx(recorded["val_loss"], rel=OTHER_CPU_RTOL)
