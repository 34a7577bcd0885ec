"""DeepSpeed's C++ ops (``shm_comm``, ``cpu_adam``) are compiled on first use and cached: which ninja compiles them.

torch builds them with the first ``ninja`` on ``PATH``. A machine may have its own (Debian's ninja-build
1.11) besides the one this Python environment installs with DeepSpeed (pip's, 1.13). The two do not
accept each other's record of the cached build, so every switch between them compiled both ops again,
about 70 CPU-seconds each: ``make install`` built them without the venv on ``PATH``, ``make test`` ran
with it, and the test suite's processes took turns (three rebuilds in one CI run, two cores busy for
minutes each time).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path


def use_this_environments_ninja() -> None:
    """Put this Python environment's scripts folder first on ``PATH`` when it holds a ``ninja``, so that
    every process of the project compiles DeepSpeed's ops with the same one (and its children inherit it)."""
    scripts = sysconfig.get_path("scripts")
    if not (Path(scripts) / "ninja").is_file():
        return
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != scripts]
    os.environ["PATH"] = os.pathsep.join([scripts, *rest])
