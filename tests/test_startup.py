"""tests/startup/sitecustomize.py, which every process of the suite runs: imports that a process does not use
wait for their first use, and what is then used is the real thing."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import STARTUP


def _child(script: str) -> list[str]:
    """The lines ``script`` prints in a fresh interpreter started as a Ray worker is: with the start-up file
    found on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(STARTUP), "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


# A training worker: DeepSpeed's ZeRO optimizer imports Muon. Then a kernel's first call, with torch.compile
# recorded (inductor would spend a minute compiling it on two cores) and the kernel's own function run where
# the compiled one would be; then the autotuner's mlflow, which nothing read until then.
_WORKER = """
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

# A tokenizer actor: the tiny tokenizer loaded as the pipeline loads it, then torch used through the module
# that deferred it.
_TOKENIZER = """
import sys
from raytrain_hymt.tokenizer import load_tokenizer
tok = load_tokenizer("tiny")
print("tokens:", tok("Hello world")["input_ids"] == tok.encode("Hello world"), "torch imported:", "torch" in sys.modules)
from transformers import modeling_rope_utils
print("torch on use:", modeling_rope_utils.torch.arange(3).tolist(), modeling_rope_utils.torch.__version__ ==
      sys.modules["torch"].__version__)
"""


def test_muon_kernels_and_the_autotuners_mlflow_load_at_first_use_not_at_import():
    assert _child(_WORKER)[-5:] == [
        "compiler stack imported: False",
        "compiled: ['zeropower_via_newtonschulz5']",
        "same as eager: True",
        "mlflow imported: False True",
        "mlflow on use: mlflow.tracking.fluent True",
    ]


def test_a_tokenizer_loads_without_torch_until_torch_is_used():
    assert _child(_TOKENIZER)[-2:] == ["tokens: True torch imported: False", "torch on use: [0, 1, 2] True"]


# A process that loads a tokenizer's or a model's classes: transformers' lazy modules read the model folders
# (os.scandir of transformers/models) only where no process stored their import structure before.
_STRUCTURE = """
import os
scanned = []
scandir = os.scandir
os.scandir = lambda path=".": scanned.append(os.fspath(path)) or scandir(path)
from transformers import AutoConfig
from transformers.utils import import_utils
models = os.path.join(os.path.dirname(import_utils.__file__), os.pardir, "models")
print("models read:", sum(os.path.samefile(p, models) for p in scanned))
print("as read now:", import_utils.define_import_structure(models, "models") ==
      import_utils.define_import_structure.uncached(models, "models"), AutoConfig.__module__)
"""


def test_transformers_import_structure_is_read_from_the_model_folders_once_then_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first = _child(_STRUCTURE)[-2:]
    entries = sorted(p.name for p in (tmp_path / f"hymt-import-structure-{os.getuid()}").iterdir())
    assert _child(_STRUCTURE)[-2:] == ["models read: 0", "as read now: True transformers.models.auto.configuration_auto"]
    assert first == ["models read: 2", "as read now: True transformers.models.auto.configuration_auto"]
    assert len(entries) >= 2 and all(e.endswith(".pickle") for e in entries)
