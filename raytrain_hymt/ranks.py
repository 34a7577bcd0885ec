"""How a global batch divides over ranks and micro-steps, and the sums every rank agrees on.

Every worker reads the whole ordered row stream and takes its own slice of each global batch of
``world × accumulation × micro_batch`` rows (``rank_slice``; ``optim.global_batch_rows`` fixes that
product and the accumulation follows the worker count): the same rows form global step k whatever
the worker count. The loss of a step is the sum of token losses over the whole global batch divided by
its target-token count (one all-reduce), so any split over workers and micro-steps gives the same
gradients.
"""

from __future__ import annotations

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


def step_loss(losses: list, rank: int, world: int, device) -> tuple[float, list[int]]:
    """The step's summed token loss over every rank and micro-step, and the ranks whose loss was NaN or
    infinite, from the micro-steps' loss tensors (still on the device): one all-reduce and one host sync
    per optimizer step, instead of a ``float(loss)`` and an all-reduce per micro-step."""
    import torch
    import torch.distributed as dist

    total = losses[0].double()
    for loss in losses[1:]:  # in micro-step order, as a host-side sum would add them
        total = total + loss.double()
    values = torch.zeros(1 + world, dtype=torch.float64, device=device)
    values[0] = total
    values[1 + rank] = (~torch.isfinite(torch.stack(losses))).any().double()
    if dist.is_initialized():
        dist.all_reduce(values)
    values = values.tolist()
    return values[0], [r for r in range(world) if values[1 + r]]
