"""Build DeepSpeed's JIT C++ ops once, before training or tests need them (``python scripts/build_ds_ops.py``; ``make install`` runs it).

On CPU every DeepSpeed run needs ``shm_comm`` and optimizer offload needs ``cpu_adam``; each takes
20-70 s and several GB of RAM to compile the first time. Building them up front keeps that cost out of
the first training run and out of every test; the result is cached in ``TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import os
import sys
import time

CPU_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")


def build_cpu_ops(names: tuple[str, ...] = CPU_OPS) -> None:
    """Compile (or load from cache) the named DeepSpeed ops for the CPU accelerator."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    from raytrain_hymt.train.engine import use_this_environments_ninja

    use_this_environments_ninja()  # the ninja every later run finds, or each would build the ops again

    accelerator = get_accelerator()
    for name in names:
        started = time.time()
        accelerator.create_op_builder(name).load(verbose=False)
        print(f"DeepSpeed op {name}: ready ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    build_cpu_ops(tuple(sys.argv[1:]) or CPU_OPS)
