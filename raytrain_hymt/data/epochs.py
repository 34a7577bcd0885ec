"""Which rows form each global batch of each epoch, laid out so that every rank reads only its own rows.

The pipeline gives the training rows one seeded order (the stream). An epoch cuts the stream into windows
of ``W`` rows (``data.epoch_shuffle_rows`` rounded down to whole global batches of ``G`` rows) and each
window of ``n`` rows into ``G`` lanes: lane ``j`` is the contiguous stretch of ``L = n // G`` rows
starting at ``offset + j·L`` (``offset`` is 0 for a whole window; the last, shorter window leaves
``n - G·L`` rows out, starting at a seeded offset, so a different few each epoch). Global batch ``b`` of
the window takes from every lane ``j`` its row ``perm_j[b]``, where ``perm_j`` is the permutation of
``L`` rows seeded by ``(data.seed, epoch, window, j)``; that row sits at position ``j`` of the batch.

So the rows of a global batch depend on the seed, the epoch and the stream only, never on the worker
count; and because position ``j`` is always filled from lane ``j``, the ranks that train positions
``P`` (:func:`rank_lanes`) need only those lanes' stretches of each window: about ``W / world`` rows,
contiguous, fetched before they are trained on and never sliced out of rows read in full. A resumed run
that skips the first ``skip`` batches of an epoch skips whole windows unread.

The price of lanes, compared with one permutation of the whole window: two rows of the same lane never
share a global batch in that epoch (their lane changes only when the window does), and a row's position
in its batch (so its rank) is the same every epoch. The rows are already in a seeded order, so a lane is
a random sample of its window; the gradient of a step does not depend on which rank computed which row.

Pure: numpy only. The fetch itself is :mod:`raytrain_hymt.data.blocks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from raytrain_hymt.config.schema import Config
    from raytrain_hymt.data.stats import DataStats

#: ``fetch(ranges)``: the rows of the stream ranges ``[(start, stop), ...]``, concatenated in that order,
#: as numpy columns.
Fetch = Callable[[list[tuple[int, int]]], dict[str, np.ndarray]]


def window_rows(shuffle_rows: int, global_rows: int) -> int:
    """Rows per window: ``shuffle_rows`` rounded down to whole global batches (at least one)."""
    return max(1, shuffle_rows // global_rows) * global_rows


def block_rows(cfg: Config, stats: DataStats | None = None) -> int:
    """Rows per block of the training rows (object-store blocks, Parquet row groups): one lane of a
    whole window of ``cfg``'s global batch, so that every rank's stretch of a window is whole blocks.
    A stream shorter than a window (``stats``: the fewest rows its examples can make, one per example
    or their tokens in full packs) gets one lane of itself: else one block would hold the whole stream,
    and every rank would fetch it."""
    global_rows = cfg.optim.rows_per_step(cfg.scaling.num_workers)
    window = window_rows(cfg.data.epoch_shuffle_rows, global_rows)
    if stats is not None:
        fewest = -(-stats.train_tokens // cfg.data.pack_tokens) if cfg.data.packing else stats.train_examples
        window = min(window, fewest)
    return max(1, window // global_rows)


def rank_lanes(rank: int, world: int, accum: int, micro_batch: int) -> list[int]:
    """Positions of the global batch (lanes) that ``rank`` trains, in micro-step order: micro-step
    ``a`` takes positions ``[(a·world + rank)·b, (a·world + rank + 1)·b)`` (:func:`rank_slice`)."""
    return [lane_start(a, rank, world, micro_batch) + i for a in range(accum) for i in range(micro_batch)]


def lane_start(micro: int, rank: int, world: int, micro_batch: int) -> int:
    """The first position of the global batch that ``rank`` trains in micro-step ``micro``: the one
    formula of the rank layout, which the fetch (:func:`rank_lanes`) and the slicing (:func:`rank_slice`)
    both follow."""
    return (micro * world + rank) * micro_batch


def epoch_windows(total_rows: int, window: int) -> list[tuple[int, int]]:
    """``(first stream row, rows)`` of each window of an epoch; the last one may be shorter."""
    return [(start, min(window, total_rows - start)) for start in range(0, total_rows, window)]


def lane_layout(n: int, global_rows: int, seed: int, epoch: int, window: int) -> tuple[int, int]:
    """``(lane rows, offset)`` of a window of ``n`` rows: ``n // global_rows`` rows per lane, and where
    lane 0 starts (seeded: the ``n mod global_rows`` rows left out differ from epoch to epoch)."""
    lane, spare = divmod(n, global_rows)
    # Key global_rows: after the last lane's, so the offset's stream is none of the lanes' streams.
    offset = int(_rng(seed, epoch, window, global_rows).integers(0, spare + 1)) if spare and lane else 0
    return lane, offset


def lane_permutation(lane: int, seed: int, epoch: int, window: int, j: int) -> np.ndarray:
    """The order in which lane ``j`` of ``window`` gives its ``lane`` rows to the window's batches."""
    return _rng(seed, epoch, window, j).permutation(lane)


def _rng(seed: int, epoch: int, window: int, key: int) -> np.random.Generator:
    # PCG64 seeded by the tuple: the same stream on every machine and numpy version that keeps PCG64.
    return np.random.default_rng([seed & (2**64 - 1), epoch, window, key])


def lane_ranges(start: int, lane: int, offset: int, lanes: Sequence[int]) -> list[tuple[int, int]]:
    """Stream rows of ``lanes`` in a window that starts at stream row ``start``, one range per lane."""
    first = start + offset
    return [(first + j * lane, first + (j + 1) * lane) for j in lanes]


def batches(fetch: Fetch, total_rows: int, window: int, global_rows: int, lanes: Sequence[int], seed: int,
            epoch: int, skip: int) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
    """``(epoch, index in epoch, rows)`` from ``epoch`` on, without end: ``rows`` are the positions
    ``lanes`` of each global batch, in that order (all lanes, ``range(global_rows)``: the whole batch).

    Each window's lanes are fetched once (``fetch``), when the first of its batches is due; the first
    ``skip`` batches of the first epoch (trained before a resume) are left out, and a window that holds
    only such batches is never fetched.
    """
    while True:
        index = 0
        for w, (start, n) in enumerate(epoch_windows(total_rows, window)):
            lane, offset = lane_layout(n, global_rows, seed, epoch, w)
            if index + lane <= skip:
                index += lane
                continue
            rows = fetch(lane_ranges(start, lane, offset, lanes))
            orders = np.stack([lane_permutation(lane, seed, epoch, w, j) for j in lanes])  # [lanes, lane]
            base = np.arange(len(lanes)) * lane  # where each lane's rows begin in ``rows``
            for b in range(lane):
                if index >= skip:
                    take = base + orders[:, b]
                    yield epoch, index, {k: v[take] for k, v in rows.items()}
                index += 1
        epoch, skip = epoch + 1, 0


def rank_slice(global_batch: dict[str, np.ndarray], micro: int, rank: int, world: int, micro_batch: int) -> dict:
    """Rows of ``global_batch`` that ``rank`` trains on in micro-step ``micro``.

    Layout: micro-step a of rank r takes rows ``[(a·world + r)·b, (a·world + r + 1)·b)``, so with one
    micro-step per optimizer step rank r holds the r-th contiguous block of the global batch.
    """
    start = lane_start(micro, rank, world, micro_batch)
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
