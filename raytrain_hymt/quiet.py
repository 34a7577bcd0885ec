"""Keep the console readable: Ray Data's per-operator progress and INFO chatter off; our lines stay.

Called on the driver and at the start of every worker (each process has its own DataContext).
"""

from __future__ import annotations

import logging
import os

NOISY_LOGGERS = ("ray.data", "ray.train", "ray.tune", "deepspeed", "DeepSpeed", "torch.distributed")


def quiet_ray() -> None:
    """Silence progress bars and INFO logs of Ray Data / Ray Train / DeepSpeed (``HYMT_VERBOSE=1``: keep)."""
    if os.environ.get("HYMT_VERBOSE"):
        return
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.enable_operator_progress_bars = False
    ctx.print_on_execution_start = False
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
