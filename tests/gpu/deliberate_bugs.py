"""Break each feature the GPU suite guards, one at a time, and run the test that guards it: each must fail.

    python3 tests/gpu/deliberate_bugs.py [NAME ...] > bugs.jsonl

Each bug is a one-line change of the package (applied to the file, its test run in a fresh pytest process,
the file restored whatever happens); a bug whose test passes is a test that does not guard its feature.
One JSON line per bug: name, test, pytest's exit status (0: NOT caught), the failure's summary lines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: name → (file, text, its broken replacement, the test file, pytest -k)
BUGS = {
    "flex mask without the document condition": (
        "raytrain_hymt/data/packing.py",
        "return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (kv_idx <= q_idx)",
        "return kv_idx <= q_idx",
        "tests/gpu/test_training_math.py", "flex_document_mask"),
    "fused loss averaged instead of summed": (
        "raytrain_hymt/train/model.py", 'ignore_index=-100, reduction="sum")', 'ignore_index=-100, reduction="mean")',
        "tests/gpu/test_training_math.py", "fused_loss and 3"),
    "compiled layers with a wrong norm epsilon": (
        "raytrain_hymt/train/worker.py", "                layer.compile()",
        "                layer.compile(); layer.input_layernorm.variance_epsilon = 0.1",
        "tests/gpu/test_training_math.py", "compiled_layers"),
    "ZeRO-3 with ten times the learning rate": (
        "raytrain_hymt/train/engine.py", '"lr": opt.lr,', '"lr": opt.lr * (10 if ds.zero_stage == 3 else 1),',
        "tests/gpu/test_training_math.py", "zero3_gives"),
    "an overflowing fp16 step reported as applied": (
        "raytrain_hymt/train/worker.py", "skipped = not self.engine.was_step_applied()", "skipped = False",
        "tests/gpu/test_training_math.py", "fp16"),
    "static decoder's position advancing by 2": (
        "raytrain_hymt/evaluation/generation.py", "self.position.add_(1)", "self.position.add_(2)",
        "tests/gpu/test_static_decoding.py", "stop_early"),
    "MFU from a thousand times the FLOPs": (
        "raytrain_hymt/train/worker.py", "util = mfu(flops, seconds,", "util = mfu(flops * 1000, seconds,",
        "tests/gpu/test_hymt_gpu.py", "lora-fast"),
    "no BLEU during training under ZeRO-3": (
        "raytrain_hymt/evaluation/during_training.py", "return every is not None and step % every == 0",
        "return every is not None and step % every == 0 and not self.sharded",
        "tests/gpu/test_hymt_gpu.py", "zero3"),
    "translate and evaluate on the CPU by default": (
        "raytrain_hymt/driver/evaluate.py", 'use_gpu = explicit.get("scaling.use_gpu", cuda_available)',
        'use_gpu = explicit.get("scaling.use_gpu", False)',
        "tests/gpu/test_hymt_gpu.py", "translate_and_evaluate"),
}


def run(name: str) -> dict:
    file, text, broken, test, k = BUGS[name]
    path = ROOT / file
    original = path.read_text()
    if original.count(text) != 1:
        return {"bug": name, "error": f"{file} no longer holds {text!r} once: update this bug"}
    try:
        path.write_text(original.replace(text, broken))
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test, "-k", k],
                              cwd=ROOT, capture_output=True, text=True, check=False)
    finally:
        path.write_text(original)
    lines = done.stdout.splitlines()
    summary = [line for line in lines if line.startswith(("E ", "FAILED", "ERROR"))][:6] or lines[-3:]
    return {"bug": name, "test": f"{test} -k '{k}'", "exit": done.returncode, "caught": done.returncode == 1,
            "failure": summary}


def main(names: list[str]) -> int:
    missed = 0
    for name in names or list(BUGS):
        result = run(name)
        missed += not result.get("caught")
        print(json.dumps(result, ensure_ascii=False), flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
