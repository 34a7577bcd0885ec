"""One progress display for data preparation (``hymt prepare``, and ``hymt train`` before training
starts), in place of Ray Data's bars.

The pipeline runs several Ray Data executions one after the other (read, clean, tokenize and sort; then
pack the training rows; then the validation rows; for ``hymt prepare`` also count the written files), and
Ray Data draws a bar of its own for each ("Running Dataset: dataset_..._0. Active & requested resources:
..."). At default verbosity ``quiet.py`` turns those off and :func:`showing` draws one bar across all of
them: the stage, the pairs read, the examples tokenized, the sort partitions packed, and the time since
preparation began. Without a terminal (CI, ``ray job logs``) it prints one concise line when a stage
ends instead. ``HYMT_VERBOSE=1`` shows Ray Data's own bars and not this one.

The numbers are Ray Data's operator metrics, read by an execution callback
(``DataContext.custom_execution_callback_classes``) that the streaming executor calls on the driver
after every scheduling step. Operators are told apart by the pipeline's function names.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

from ray.data._internal.execution.execution_callback import ExecutionCallback

from raytrain_hymt.data.packing import as_single_rows, pack_examples
from raytrain_hymt.data.prepared import PREPARED_READER
from raytrain_hymt.data.tokenize import TokenizePairs

log = logging.getLogger(__name__)

#: The display in use (the callback of every execution on this driver draws on it); None: none.
_display: _Display | None = None
#: Seconds between two redraws of the bar, and between two lines while an execution runs (no terminal).
REDRAW_S = 0.25
LINE_EVERY_S = 60.0


def stage_of(op_name: str) -> str | None:
    """What the user calls the work of the (possibly fused) Ray Data operator ``op_name``; None: a step
    between stages (a filter, a projection, a repartition)."""
    parts = op_name.split("->")
    if any(f"({fn.__name__})" in p for p in parts for fn in (pack_examples, as_single_rows)):
        return "packing"  # hymt prepare writes each packed block as it comes (data.prepared)
    if any(f"({TokenizePairs.__name__})" in p for p in parts):
        return "tokenizing"
    if parts[0].startswith(f"Read{PREPARED_READER}"):
        return "reading prepared rows"
    if parts[0].startswith("Read"):
        return "reading"
    if parts[0].startswith("Sort"):
        return "sorting"
    if "count_rows" in op_name:
        return "counting rows"
    return None


def counts_of(ops) -> dict[str, int]:
    """``read``, ``tokenized``, ``packed`` and ``to_pack`` of one execution's operators (rows the reader
    produced, rows the tokenizer produced, and input blocks — sort partitions — packing finished and
    received)."""
    out = {"read": 0, "tokenized": 0, "packed": 0, "to_pack": 0}
    for op in ops:
        stage, m = stage_of(op.name), op.metrics
        if stage == "reading":
            out["read"] += m.rows_task_outputs_generated
        elif stage == "tokenizing":
            out["tokenized"] += m.rows_task_outputs_generated
        elif stage and stage.startswith("packing"):
            out["packed"] += m.num_task_inputs_processed
            out["to_pack"] += m.num_inputs_received
    return out


def current_stage(ops) -> str | None:
    """The stage of the first operator that has not finished (upstream first), or None."""
    for op in ops:
        stage = stage_of(op.name)
        if stage and not op.has_completed():
            return stage
    return None


class _Display:
    """The bar (a terminal) or the lines (none), fed by the executions' callbacks; thread-safe."""

    def __init__(self, stream):
        self.stream, self.tty = stream, stream.isatty()
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.done = dict.fromkeys(("read", "tokenized", "packed", "to_pack"), 0)  # of finished executions
        self.running = dict(self.done)
        self.stage, self.drawn_at, self.printed, self.bar = "starting", self.started, "", None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(desc=self.text(), file=stream, bar_format="{desc} [{elapsed}]", dynamic_ncols=True)

    def text(self, stage: bool = True) -> str:
        """``data: <stage>: N pairs read, N tokenized, k/n partitions packed`` (``stage``: with the stage)."""
        n = {k: self.done[k] + self.running[k] for k in self.done}
        parts = [f"{n['read']} pairs read"] if n["read"] else []
        if n["tokenized"]:
            parts.append(f"{n['tokenized']} tokenized")
        if n["to_pack"]:
            parts.append(f"{n['packed']}/{n['to_pack']} partitions packed")
        head = f"data: {self.stage}" if stage else "data"
        return head + (": " + ", ".join(parts) if parts else "")

    def step(self, ops, finished: bool = False) -> None:
        """Take one execution's operators (``finished``: its last look at them) and redraw."""
        with self.lock:
            self.running = counts_of(ops)
            self.stage = current_stage(ops) or self.stage
            if finished:
                self.done = {k: self.done[k] + self.running[k] for k in self.done}
                self.running = dict.fromkeys(self.done, 0)
            now = time.monotonic()
            if self.bar is not None:
                if finished or now - self.drawn_at >= REDRAW_S:
                    self.drawn_at = now
                    self.bar.set_description_str(self.text(), refresh=True)
            elif finished:  # what is done so far, so without the stage that just ended
                self._print(self.text(stage=False))
            elif now - self.drawn_at >= LINE_EVERY_S:
                self._print(self.text())

    def _print(self, text: str) -> None:
        if text != self.printed:  # executions that add nothing (counting rows) print no second line
            self.printed, self.drawn_at = text, time.monotonic()
            print(f"{text} ({self.drawn_at - self.started:.0f} s)", file=self.stream, flush=True)

    def close(self, ok: bool) -> None:
        """Leave the last state (``ok``: the preparation finished): the bar closed on it, or its line
        unless the last line said it already. Nothing stays when no execution reported anything (the
        preparation failed before it read, or read nothing through Ray Data)."""
        with self.lock:
            seen = any(self.done.values())
            if self.bar is not None:
                self.stage = "done" if ok else self.stage
                self.bar.leave = seen
                self.bar.set_description_str(self.text(), refresh=seen)
                self.bar.close()
            elif seen:
                self._print(self.text(stage=False))


class DataProgress(ExecutionCallback):
    """Ray Data execution callback: hands the executor's operators to the display in use, if any (the
    class travels with every dataset's DataContext, also to training workers: there it does nothing)."""

    def on_execution_step(self, executor) -> None:
        self._show(executor, finished=False)

    def after_execution_succeeds(self, executor) -> None:
        self._show(executor, finished=True)

    def after_execution_fails(self, executor, error) -> None:
        self._show(executor, finished=True)

    @staticmethod
    def _show(executor, finished: bool) -> None:
        display = _display
        if display is None:
            return
        try:
            # The executor's operators, in upstream-first order: Ray Data's own callbacks read them so.
            ops = [op for op in (executor._topology or ()) if op.name != "Input"]
            display.step(ops, finished)
        except Exception:  # progress is cosmetic: an error here would fail the execution
            log.debug("data preparation progress: could not read the executor", exc_info=True)


@contextlib.contextmanager
def showing(stream=None):
    """Draw the preparation's progress on ``stream`` (default stderr) while the block runs. The datasets
    have to be created inside (a dataset keeps the DataContext, with its callbacks, of its creation).
    Does nothing when verbose (Ray Data's bars are on then) or nested in another ``showing``."""
    global _display
    from raytrain_hymt.quiet import verbose

    if verbose() or _display is not None:
        yield
        return
    import ray.data
    from tqdm.contrib.logging import logging_redirect_tqdm

    from raytrain_hymt.quiet import quiet_ray

    quiet_ray(driver=True)  # Ray Data's bars off (and the console filters in place) before the first execution
    callbacks = ray.data.DataContext.get_current().custom_execution_callback_classes
    added = DataProgress not in callbacks
    if added:
        callbacks.append(DataProgress)
    _display, ok = _Display(stream or sys.stderr), False
    try:
        # Log lines (bad rows, where the dataset went) go above the bar, not into it.
        with logging_redirect_tqdm() if _display.tty else contextlib.nullcontext():
            yield
        ok = True
    finally:
        display, _display = _display, None
        display.close(ok)
        if added:
            callbacks.remove(DataProgress)
