"""tests/startup/sitecustomize.py, which every process of the suite runs: DeepSpeed's Muon kernels are compiled
at their first call, not at import, and compute what they computed; its autotuner's mlflow is imported when
the autotuner first uses it."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import STARTUP

# A fresh interpreter, as a Ray worker starts: the start-up file found on PYTHONPATH, then DeepSpeed's ZeRO
# optimizer imports Muon. Then the first call of a kernel, with torch.compile recorded (inductor would spend
# a minute compiling it on two cores) and the kernel's own function run where the compiled one would be.
_CHILD = """
import sys
import torch
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
print("compiler stack imported:", "torch._functorch.aot_autograd" in sys.modules)
compiled = []
torch.compile = lambda fn: compiled.append(fn) or fn
kernel = original_muon.zeropower_via_newtonschulz5
g = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
out = kernel(g, 5)
kernel(g, 5)
print("compiled:", [f.__name__ for f in compiled])
print("same as eager:", torch.equal(out, kernel.__wrapped__(g, 5)))
from deepspeed.autotuning import autotuner
print("mlflow imported:", "mlflow" in sys.modules, autotuner.has_mlflow)
start_run = autotuner.mlflow.start_run
print("mlflow on use:", start_run.__module__, sys.modules["mlflow"].start_run is start_run)
"""


def test_muon_kernels_and_the_autotuners_mlflow_load_at_first_use_not_at_import():
    env = {**os.environ, "PYTHONPATH": str(STARTUP), "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-5:] == [
        "compiler stack imported: False",
        "compiled: ['zeropower_via_newtonschulz5']",
        "same as eager: True",
        "mlflow imported: False True",
        "mlflow on use: mlflow.tracking.fluent True",
    ]
