"""Test-only fault injection and a per-step record of what each rank trained on.

Both are switched on by environment variables that the driver forwards to the workers, so no config field
and no code path of a normal run changes:

``HYMT_FAULTS``: a JSON list of faults, each ``{"kind": "sigkill" | "raise" | "stall" | "nan", "rank": R,
"step": K, "once": "/path/marker"}``. ``sigkill``, ``raise`` and ``stall`` fire when rank R is about to
train step K (the process kills itself with SIGKILL, raises ``InjectedFault``, or sleeps the fault's
``"seconds"``, or less if the file named by its ``"until"`` appears first: a run held there while a test
changes the cluster or restarts a server); ``nan`` makes rank R's loss NaN in
step K; ``enospc`` stands in for a disk that fills up while rank R's checkpoint of step K is copied into
storage: ``checkpoint.save_rank_checkpoint`` leaves empty files where that checkpoint's ``state.json`` (rank 0)
and the rank's marker go under the fault's ``"run_dir"`` (the run folder in storage), as a cut-off copy
does, then raises ``OSError(ENOSPC)``. With ``once``, a fault fires only if the marker file does not exist
yet and creates it first, so the restarted attempt runs through.

``HYMT_RECORD_DIR``: each rank appends one JSON line per step to ``<dir>/rank<R>.jsonl``: the step, the
example ids of its rows, the loss, whether the update was skipped, the sum of the model's weights, the
Ray node it ran on, the attempt's worker count and the wall-clock time, how many decoder-layer forwards the
step ran and whether every module was in training mode during them (``watch_layers``: two forwards per layer and micro-step
show that activation checkpointing really recomputes), and the rows, blocks and bytes of training data
the rank fetched so far (``data.blocks.RowFetcher``).

Both cost nothing when their variable is unset: each function returns at its first line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

FAULTS_ENV = "HYMT_FAULTS"
RECORD_ENV = "HYMT_RECORD_DIR"
#: Environment variables the driver passes on to the workers (trainer.build_trainer).
FORWARDED_ENV = (FAULTS_ENV, RECORD_ENV)


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


def _due(kind: str, step: int, rank: int) -> dict | None:
    """The fault of ``kind`` due for ``rank`` at ``step`` (its marker created when it has ``once``), or None."""
    for fault in json.loads(os.environ.get(FAULTS_ENV) or "[]"):
        if fault["kind"] != kind or fault["step"] != step or fault["rank"] != rank:
            continue
        once = fault.get("once")
        if once:
            try:
                # O_EXCL: exactly one attempt ever sees the marker missing.
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                continue
        return fault
    return None


def before_step(step: int, rank: int) -> None:
    """Fire the ``sigkill`` or ``raise`` fault due for ``rank`` at ``step``, if any."""
    if not os.environ.get(FAULTS_ENV):
        return
    if _due("sigkill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if _due("raise", step, rank):
        raise InjectedFault(f"injected failure on rank {rank} at step {step}")
    stall = _due("stall", step, rank)
    if stall:
        deadline, until = time.monotonic() + stall["seconds"], stall.get("until")
        while time.monotonic() < deadline and not (until and os.path.exists(until)):
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def disk_full(step: int, rank: int, checkpoint_dir: str, files: list[str]) -> None:
    """Fire the ``enospc`` fault due for ``rank`` at ``step``, if any: empty ``files`` (paths relative to
    the checkpoint) in ``<run_dir>/<checkpoint_dir>``, then ``OSError(ENOSPC)`` naming the first."""
    if not os.environ.get(FAULTS_ENV):
        return
    fault = _due("enospc", step, rank)
    if not fault:
        return
    for name in files:
        target = Path(fault["run_dir"], checkpoint_dir, name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(fault["run_dir"], checkpoint_dir, files[0])))


@contextlib.contextmanager
def nan_loss(module, step: int, rank: int):
    """While active, ``module``'s logits are NaN if a ``nan`` fault is due for ``rank`` at ``step``."""
    if not os.environ.get(FAULTS_ENV) or not _due("nan", step, rank):
        yield
        return
    import torch

    def poison(_module, _inputs, output):
        if isinstance(output, torch.Tensor):  # model.fused_loss: the model returns the loss itself
            return output * float("nan")
        output.logits = output.logits * float("nan")
        return output

    handle = module.register_forward_hook(poison)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def watch_layers(module):
    """While active (only with ``HYMT_RECORD_DIR``), count the decoder layers' forwards (recomputations
    included) and note whether every module of each layer was in training mode; yields the tally."""
    seen = {"layer_forwards": 0, "training": True}
    if not os.environ.get(RECORD_ENV):
        yield seen
        return

    layers = [m for m in module.modules() if type(m).__name__.endswith("DecoderLayer")]

    def count(layer):
        def hook(_mlp, _args):
            seen["layer_forwards"] += 1
            seen["training"] = seen["training"] and all(m.training for m in layer.modules())
        return hook

    # Each layer's MLP, not the layer itself: transformers checkpoints the layer's own forward, so a
    # recomputation in backward runs the layer's children again but never the layer's forward hooks.
    handles = [layer.mlp.register_forward_pre_hook(count(layer)) for layer in layers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def record_step(rank: int, step: int, example_ids: Callable[[], list[int]], loss: float, skipped: bool, module,
                layers: dict | None = None, fetched: dict | None = None) -> None:
    """Append this rank's line for ``step`` to ``$HYMT_RECORD_DIR/rank<R>.jsonl`` (no-op when unset);
    ``example_ids``: gives the ids of the rows the rank trained on (called only when recording);
    ``layers``: the tally of ``watch_layers`` during the step; ``fetched``: what the rank's fetcher
    counted so far in this worker process (``data.blocks.RowFetcher.counts``)."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    import torch

    with torch.no_grad():
        weight_sum = float(sum(p.detach().double().sum() for p in module.parameters()))
    import ray.train

    line = {"step": step, "example_ids": sorted(int(e) for e in example_ids()), "loss": loss,
            "skipped": skipped, "weight_sum": weight_sum, "node": ray.get_runtime_context().get_node_id(),
            "world": ray.train.get_context().get_world_size(), "pid": os.getpid(), "time": time.time(),
            **(layers or {}), **(fetched or {})}
    Path(folder).mkdir(parents=True, exist_ok=True)
    # One open/write/close per line: a SIGKILL right after loses nothing already recorded.
    with open(Path(folder, f"rank{rank}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")
