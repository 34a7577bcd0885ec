"""How a global batch divides over ranks and micro-steps, and the sums every rank agrees on.

A global batch has ``world × accumulation × micro_batch`` rows (``optim.global_batch_rows`` fixes that
product and the accumulation follows the worker count). Each rank fetches only the positions it trains
(``data.epochs.rank_lanes``: micro-step a of rank r holds positions ``[(a·world + r)·b, (a·world + r +
1)·b)``, the layout of ``rank_slice``) and trains them as its ``rank rows``: micro-step a is rows
``[a·b, (a+1)·b)`` of them (``micro_slice``). The same rows form global step k whatever the worker count.
The loss of a step is the sum of token losses over the whole global batch divided by its target-token
count (one all-reduce), so any split over workers and micro-steps gives the same gradients.
"""

from __future__ import annotations

import numpy as np

from raytrain_hymt.data.epochs import rank_lanes


def rank_slice(global_batch: dict[str, np.ndarray], micro: int, rank: int, world: int, micro_batch: int) -> dict:
    """Rows of ``global_batch`` that ``rank`` trains on in micro-step ``micro``.

    Layout: micro-step a of rank r takes rows ``[(a·world + r)·b, (a·world + r + 1)·b)``, so with one
    micro-step per optimizer step rank r holds the r-th contiguous block of the global batch.
    """
    start = (micro * world + rank) * micro_batch
    return {k: v[start : start + micro_batch] for k, v in global_batch.items()}


def rank_rows(global_batch: dict[str, np.ndarray], rank: int, world: int, grad_accum: int, micro_batch: int) -> dict:
    """The rows of a whole ``global_batch`` that ``rank`` trains, as ``Worker.train_step`` takes them
    (what the rank would have fetched itself: its lanes, in micro-step order)."""
    take = rank_lanes(rank, world, grad_accum, micro_batch)
    return {k: v[take] for k, v in global_batch.items()}


def micro_slice(rows: dict[str, np.ndarray], micro: int, micro_batch: int) -> dict:
    """Micro-step ``micro`` of a rank's rows (``rank_rows``, or the rows the rank fetched)."""
    return {k: v[micro * micro_batch : (micro + 1) * micro_batch] for k, v in rows.items()}


def steps_per_epoch(train_rows: int, world: int, grad_accum: int, micro_batch: int) -> int:
    """Optimizer steps in one pass (the incomplete last global batch is dropped on every rank alike)."""
    return train_rows // (world * grad_accum * micro_batch)


def rank_example_ids(rows: dict) -> list[int]:
    """Example ids of a rank's rows (every packed row's examples)."""
    return [int(e) for row in rows["example_ids"] for e in row]


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
