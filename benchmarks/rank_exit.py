"""The end of a benchmark rank that runs outside Ray: a torchrun rank, a spawned process."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def end_rank() -> NoReturn:
    """Destroy the process group, flush what the rank printed and logged, and end the process at once,
    without the interpreter's shutdown. Call it once the rank's results are written.

    A gloo worker thread frees the work of the collective it just ran after the rank has been told that the
    collective finished, and freeing a tensor Python also holds takes the GIL. If the interpreter is shutting
    down by then, Python ends that thread inside a C++ destructor, and a rank whose work is done aborts
    ("terminate called without an active exception", exit -6; docs/fault-tolerance.md explains it).
    ``destroy_process_group`` does not stop those threads here: DeepSpeed's engine, and default arguments
    bound when ``torch.distributed.nn.functional`` and ``deepspeed.comm.torch`` are imported after the group
    exists, keep the groups alive past it.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
