"""The sums every rank agrees on: one all-reduce per optimizer step for the loss, the tokens and the
failures of a step.

The loss of a step is the sum of token losses over the whole global batch divided by its target-token
count (one all-reduce), so any split over workers and micro-steps gives the same gradients.
"""

from __future__ import annotations


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
