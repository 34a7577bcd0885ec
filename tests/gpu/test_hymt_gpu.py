"""``hymt train``, BLEU during training, evaluation and ``hymt translate`` on the GPU, through Ray for
real: every 7B preset's own settings from a full-width Hunyuan-7B-shaped model folder of 2 layers
(gpu_models.py), one worker on this machine's GPU, the run folders in memory. The first training starts
its own local Ray, as ``hymt train`` does on a machine without a cluster."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from gpu_models import skip_without_cuda

skip_without_cuda()

from conftest import FLORES_DEVTEST  # noqa: E402
from gpu_models import model_folder, scratch_root  # noqa: E402

PRESETS = ["hy-mt-7b-zero2", "hy-mt-7b-zero3", "hy-mt-7b-offload", "hy-mt-7b-lora", "hy-mt-7b-lora-fast"]
#: The end-of-run test set and the BLEU sample during training (zero3): FLORES devtest, 4 lines each way.
BLEU = {"eval.test_set": FLORES_DEVTEST, "eval.directions": "[en-zh, zh-en]", "eval.max_sentences": 4,
        "eval.max_new_tokens": 8, "eval.bleu_every_steps": 1, "eval.bleu_sentences": 4}


def _metrics(run_dir: str) -> dict[str, list[float]]:
    from raytrain_hymt.tracking.metrics_log import read_metrics
    from pathlib import Path

    from raytrain_hymt.storage import METRICS_FILE

    out: dict[str, list[float]] = {}
    for key, value, _step, _time in read_metrics(Path(run_dir) / METRICS_FILE):
        out.setdefault(key, []).append(value)
    return out


@pytest.mark.timeout(420)
@pytest.mark.parametrize("preset", PRESETS)
def test_a_short_hymt_train_with_each_7b_preset(preset):
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.driver.train import run_training

    storage = scratch_root() / f"hymt-gpu-runs-{os.getpid()}"
    # One GPU: one worker (the full presets' 2 ask for two GPUs); two steps; no export (3 GB each, the
    # checkpoint at the last step is written all the same).
    values = {"model.name_or_path": model_folder(), "scaling.num_workers": 1, "optim.max_steps": 2,
              "run.storage_root": storage, "run.name": preset, "run.export": False, "tracking.enabled": False}
    if preset == "hy-mt-7b-zero3":
        values.update(BLEU, **{"run.export": True})  # the end-of-run test set scores the exported model
    try:
        summary = run_training(load_config(preset, [f"{k}={v}" for k, v in values.items()]))
        metrics = _metrics(summary.run_dir)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    assert summary.steps == 2 and math.isfinite(summary.train_loss)
    print(preset, {k: v for k, v in metrics.items() if k.startswith("train/")})
    # MFU from the GPU's name and the FLOPs of the step; the memory peak holds at least the bf16 weights
    # (1.49 B parameters, 2.8 GiB) unless ZeRO-3 offloads them to the CPU, and fits the card.
    mfu, mem, reserved = metrics["train/mfu"], metrics["train/memory_gib"], metrics["train/memory_reserved_gib"]
    assert len(mfu) == 2 and all(1e-4 < x < 0.9 for x in mfu), mfu
    floor = 0.5 if preset == "hy-mt-7b-offload" else 2.7
    assert all(floor < m <= r < 80 for m, r in zip(mem, reserved)), (mem, reserved)
    if preset == "hy-mt-7b-zero3":
        # BLEU during training under ZeRO-3 finished at both steps, and the GPU replicas scored the test set.
        for direction in ("en-zh", "zh-en"):
            assert len([k for k in metrics if k.endswith(f"{direction}/bleu")]) == 1
            assert len(next(v for k, v in metrics.items() if k.endswith(f"{direction}/bleu"))) == 2
        assert set(summary.test_scores["scores"]) == {"en-zh", "zh-en"}
        assert all(0 <= s["bleu"] <= 100 for s in summary.test_scores["scores"].values())


def _hymt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raytrain_hymt.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HYMT_VERBOSE": "0"})


@pytest.mark.timeout(400)
def test_translate_and_evaluate_use_the_gpu_in_bf16_by_default():
    from raytrain_hymt.train.model import load_generator

    folder = model_folder()
    sentences = ["Hello.", "Where is the station?"]
    done = _hymt("translate", "--model", folder, "--from", "en", "--to", "zh", "--set", "eval.max_new_tokens=8",
                 *sentences)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on GPU in bf16" in done.stderr + done.stdout, done.stderr[-3000:]
    # The same translations as the GPU in bf16 gives in this process.
    want = load_generator(folder, "bf16", 8, use_gpu=True).translate(sentences, ["en"] * 2, ["zh"] * 2)
    assert done.stdout.splitlines()[-2:] == want

    done = _hymt("evaluate", "--model", folder, "--test-set", str(FLORES_DEVTEST), "--directions", "en-zh",
                 "--set", "eval.max_sentences=4", "--set", "eval.max_new_tokens=8")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on GPU in bf16" in done.stderr + done.stdout, done.stderr[-3000:]
    assert "en-zh" in done.stdout, done.stdout[-2000:]
    print(json.dumps({"translate": done.stdout[-500:]}))
