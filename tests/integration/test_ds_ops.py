"""DeepSpeed's C++ ops are compiled once (``make install``) and every later process loads that build, with
whatever ``PATH`` it was started with: this machine has Debian's ninja (1.11) besides the venv's (1.13),
and before ``train.engine.use_this_environments_ninja`` each switch between them compiled both ops again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOAD = """
import sys
sys.path.insert(0, "scripts")
from build_ds_ops import build_cpu_ops
build_cpu_ops(("ShareMemCommBuilder",))
"""


def test_this_environments_ninja_comes_first_whatever_path_says(monkeypatch):
    from raytrain_hymt.train.engine import use_this_environments_ninja

    scripts = sysconfig.get_path("scripts")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin", scripts]))
    use_this_environments_ninja()
    assert shutil.which("ninja") == str(Path(scripts) / "ninja")
    assert os.environ["PATH"].split(os.pathsep) == [scripts, "/usr/bin", "/bin"]  # once, first


def test_processes_started_with_either_ninja_first_load_the_built_op_without_compiling():
    from torch.utils.cpp_extension import _get_build_directory

    built = Path(_get_build_directory("deepspeed_shm_comm", verbose=False)) / "deepspeed_shm_comm.so"
    scripts, path = sysconfig.get_path("scripts"), os.environ.get("PATH", "")
    system_first = os.pathsep.join(["/usr/bin", "/bin", path])
    venv_first = os.pathsep.join([scripts, path])
    compiled_at = []
    for first in (system_first, venv_first, system_first):  # the first load may compile (the last build's ninja)
        env = dict(os.environ, DS_ACCELERATOR="cpu", PATH=first)
        out = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        compiled_at.append(built.stat().st_mtime_ns)
    # The built library is rewritten by every compile (a recompile took 88 s here; a load takes seconds,
    # more on a busy machine, so the time itself is no test).
    assert compiled_at[1:] == compiled_at[:1] * 2, "the op was compiled again"
