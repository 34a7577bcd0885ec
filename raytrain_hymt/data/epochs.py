"""A new, reproducible order of the training rows every epoch, without holding the epoch in memory.

The pipeline gives the rows one seeded order. Each epoch reads that stream in windows of whole global
batches (``data.epoch_shuffle_rows`` rows) and permutes every window with its own seed
``(data.seed, epoch, window)``: two epochs differ, the same epoch is the same on every run, and a worker
holds one window at a time. Because an epoch's batches depend only on the seed, the epoch and the
stream, a resumed run that skips the first ``batch_in_epoch`` batches trains exactly the rows an
uninterrupted run would have trained next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np


def window_rows(shuffle_rows: int, global_rows: int) -> int:
    """Rows per window: ``shuffle_rows`` rounded down to whole global batches (at least one)."""
    return max(1, shuffle_rows // global_rows) * global_rows


def epoch_permutation(n: int, seed: int, epoch: int, window: int) -> np.ndarray:
    """The permutation of a window of ``n`` rows in ``epoch`` (PCG64 seeded with seed, epoch, window)."""
    return np.random.default_rng([seed & (2**64 - 1), epoch, window]).permutation(n)


def epoch_batches(windows: Iterable[dict[str, np.ndarray]], seed: int, epoch: int, global_rows: int) -> Iterator[dict]:
    """Global batches of ``global_rows`` rows of one epoch, from the stream's windows (numpy column
    dicts of :func:`window_rows` rows, the last one shorter): each window's rows permuted, cut into
    whole global batches; the rows of an incomplete last batch are left out, as ``drop_last`` would."""
    for index, rows in enumerate(windows):
        n = len(next(iter(rows.values())))
        order = epoch_permutation(n, seed, epoch, index)
        for start in range(0, n - global_rows + 1, global_rows):
            take = order[start : start + global_rows]
            yield {k: v[take] for k, v in rows.items()}


def global_batches(read_epoch: Callable[[], Iterable[dict[str, np.ndarray]]], seed: int, epoch: int, skip: int,
                   global_rows: int) -> Iterator[tuple[int, int, dict]]:
    """``(epoch, index in epoch, global batch)`` from ``epoch`` on, without end: each epoch reads the
    stream again (``read_epoch()`` gives its windows) in its own order; the first ``skip`` batches of the
    first epoch, trained before a resume, are left out."""
    while True:
        for index, batch in enumerate(epoch_batches(read_epoch(), seed, epoch, global_rows)):
            if index >= skip:
                yield epoch, index, batch
        epoch, skip = epoch + 1, 0
