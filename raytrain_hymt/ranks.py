"""How a global batch divides over ranks and micro-steps, and the sums every rank agrees on.

Every worker reads the whole ordered row stream and takes its own slice of each global batch of
``world × grad_accum × micro_batch`` rows (``rank_slice``): the same rows form global step k whatever
the worker count. The loss of a step is the sum of token losses over the whole global batch divided by
its target-token count (one all-reduce), so any split over workers and micro-steps gives the same
gradients.
"""

from __future__ import annotations

import math

import numpy as np


def rank_slice(global_batch: dict[str, np.ndarray], micro: int, rank: int, world: int, micro_batch: int) -> dict:
    """Rows of ``global_batch`` that ``rank`` trains on in micro-step ``micro``.

    Layout: micro-step a of rank r takes rows ``[(a·world + r)·b, (a·world + r + 1)·b)``, so with one
    micro-step per optimizer step rank r holds the r-th contiguous block of the global batch.
    """
    start = (micro * world + rank) * micro_batch
    return {k: v[start : start + micro_batch] for k, v in global_batch.items()}


def steps_per_epoch(train_rows: int, world: int, grad_accum: int, micro_batch: int) -> int:
    """Optimizer steps in one pass (the incomplete last global batch is dropped on every rank alike)."""
    return train_rows // (world * grad_accum * micro_batch)


def rank_example_ids(global_batch: dict, rank: int, world: int, grad_accum: int, micro_batch: int) -> list[int]:
    """Example ids of the rows ``rank`` trains on in ``global_batch`` (every micro-step's slice)."""
    return [int(e) for a in range(grad_accum)
            for row in rank_slice(global_batch, a, rank, world, micro_batch)["example_ids"] for e in row]


def all_reduce_sum(values: list[float], device) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def nonfinite_ranks(value: float, rank: int, world: int, device) -> list[int]:
    """Ranks whose ``value`` is NaN or infinite (one all-reduce, so every rank gets the same answer)."""
    flags = [0.0] * world
    flags[rank] = 0.0 if math.isfinite(value) else 1.0
    return [r for r, f in enumerate(all_reduce_sum(flags, device)) if f]
