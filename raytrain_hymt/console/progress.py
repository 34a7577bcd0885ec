"""Training progress on the driver's console, published by rank 0.

Rank 0's own output reaches the console only through Ray's log forwarding, which is no terminal (no bar
can redraw in place) and is off at default verbosity (``quiet.py``). So rank 0 publishes each step
(step, total, loss, validation loss, tokens/s) and its warnings to a small named actor, the
:class:`ProgressBoard` (no CPU of its own, in namespace ``hymt``; a named actor reaches every node,
unlike a file on rank 0's disk). The driver polls it twice a second and draws one tqdm bar with step/total,
loss, tokens/s and ETA when stderr is a terminal, or prints one concise line every ``console_every`` steps
(about ten a run) when it is not (CI, ``ray job logs``).

One progress display for data preparation (``hymt prepare``, and ``hymt train`` before training
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
import uuid

from ray.data._internal.execution.execution_callback import ExecutionCallback

from raytrain_hymt.data.packing import as_single_rows, pack_examples
from raytrain_hymt.data.prepared import PREPARED_READER
from raytrain_hymt.data.tokenize import TokenizePairs

log = logging.getLogger("raytrain_hymt")

NAMESPACE = "hymt"


class ProgressBoard:
    """Ray actor: the latest step rank 0 published, and its warnings in order."""

    def __init__(self):
        self.latest: dict | None = None
        self.messages: list[str] = []

    def publish(self, update: dict) -> None:
        self.latest = update

    def say(self, message: str) -> None:
        self.messages.append(message)

    def read(self, seen: int) -> tuple[dict | None, list[str]]:
        """The latest update and the messages after the first ``seen``."""
        return self.latest, self.messages[seen:]


class _Forward(logging.Handler):
    """A worker's project warnings, sent to the board (the driver prints them above the bar)."""

    def __init__(self, board, prefix: str):
        super().__init__(logging.WARNING)
        self.board, self.prefix = board, prefix
        self.sent = None  # the last message's reference: ``Publisher.close`` waits for it

    def emit(self, record: logging.LogRecord) -> None:
        self.sent = self.board.say.remote(self.prefix + self.format(record))


class Publisher:
    """A worker's side: fire-and-forget updates to the board named ``name`` (None: publish nothing).
    Every rank forwards its warnings (``rank N:`` before those of ranks other than 0); rank 0 alone
    publishes steps."""

    def __init__(self, name: str | None, rank: int = 0):
        self.board = self.handler = None
        self.rank = rank
        if name:
            self.board = wait_for_board(name)
            self.handler = _Forward(self.board, f"rank {rank}: " if rank else "")
            log.addHandler(self.handler)

    def step(self, **update) -> None:
        """Publish one step: ``step``, ``total``, ``loss``, ``tokens_per_s``, ``console_every``, ``val_loss``..."""
        if self.board is not None and self.rank == 0:
            self.board.publish.remote(update)

    def close(self) -> None:
        """Stop forwarding, once what was sent has reached the board: the driver reads it after the workers
        end, and messages sent through two handles (this rank's, the driver's) are not ordered."""
        if self.handler is None:
            return
        log.removeHandler(self.handler)
        if self.handler.sent is not None:
            import ray

            try:
                ray.get(self.handler.sent, timeout=10)
            except Exception:  # noqa: BLE001 - progress is cosmetic: a gone board never stops a worker
                pass


def line(u: dict) -> str:
    """The concise progress line of one update (without a terminal)."""
    val = f" val {u['val_loss']:.4f}" if u.get("val_loss") is not None else ""
    bleu = "".join(f" {k} {v:.2f}" for k, v in u.get("scores", {}).items())
    return (f"step {u['step']}/{u['total']} loss {u['loss']:.4f}{val}{bleu} lr {u['lr']:.2e} "
            f"{u['tokens_per_s']:.0f} tok/s/worker")


class Watcher:
    """The driver's side: creates the board, then shows what rank 0 publishes until :meth:`close`."""

    def __init__(self, stream=None, poll_s: float = 0.5):
        import ray

        self.name = f"progress-{uuid.uuid4().hex[:12]}"
        self.actor = ray.remote(ProgressBoard).options(name=self.name, namespace=NAMESPACE, num_cpus=0,
                                                       max_restarts=0).remote()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.poll_s, self.bar, self.seen, self.last_step, self.printed = poll_s, None, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hymt-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Read the board once and draw what is new."""
        import ray

        try:
            latest, messages = ray.get(self.actor.read.remote(self.seen), timeout=10)
        except Exception:  # noqa: BLE001 - progress is cosmetic: a slow or gone board never stops training
            return
        self.seen += len(messages)
        for message in messages:
            self._write(message)
        if latest and latest["step"] != self.last_step:
            self.last_step = latest["step"]
            self._draw(latest)

    def _write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def _draw(self, u: dict) -> None:
        if not self.tty:
            every = u.get("console_every", 1)
            if (u["step"] == 1 or u["step"] % every == 0 or u["step"] >= u["total"] or u.get("val_loss") is not None
                    or u.get("scores")):
                self._write(line(u))
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=u["total"], file=self.stream, unit="step", dynamic_ncols=True,
                            initial=u["step"] - 1)
        self.bar.set_postfix_str(f"loss {u['loss']:.4f} {u['tokens_per_s']:.0f} tok/s/worker", refresh=False)
        self.bar.update(u["step"] - self.bar.n)

    def close(self) -> None:
        """Show the last update, close the bar and remove the board."""
        import ray

        self._stop.set()
        self._thread.join()
        self.poll()
        if self.bar is not None:
            self.bar.close()
        ray.kill(self.actor)


def wait_for_board(name: str, timeout_s: float = 30.0):
    """The board actor ``name`` once it is registered (rank 0 may start before the driver's call lands)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


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
    from raytrain_hymt.console.quiet import verbose

    if verbose() or _display is not None:
        yield
        return
    import ray.data
    from tqdm.contrib.logging import logging_redirect_tqdm

    from raytrain_hymt.console.quiet import quiet_ray

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
