"""Training progress on the driver's console, published by rank 0.

Rank 0's own output reaches the console only through Ray's log forwarding, which is no terminal (no bar
can redraw in place) and is off at default verbosity (``quiet.py``). So rank 0 publishes each step
(step, total, loss, validation loss, tokens/s) and its warnings to a small named actor, the
:class:`ProgressBoard` (no CPU of its own, in namespace ``hymt``; a named actor reaches every node,
unlike a file on rank 0's disk). The driver polls it twice a second and draws one tqdm bar with step/total,
loss, tokens/s and ETA when stderr is a terminal, or prints one concise line every ``console_every`` steps
(about ten a run) when it is not (CI, ``ray job logs``).

Data preparation (``hymt prepare``, and ``hymt train`` or ``hymt tune`` before training starts) has no
display here: Ray Data draws a bar of its own for each of its executions ("Running Dataset:
dataset_..._0. Active & requested resources: ..."), which ``quiet.py`` turns off at default verbosity,
and the pipeline logs one concise ``data: ...`` line as each stage ends (:mod:`raytrain_hymt.data.pipeline`,
:mod:`raytrain_hymt.data.prepared`), the same with or without a terminal. ``HYMT_VERBOSE=1`` brings
Ray Data's bars back.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid

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

    def note(self, message: str) -> None:
        """A line for the driver's console (rank 0's, e.g. the checkpoint a run resumes from): logged, which
        Ray forwards when verbose (no board then), and sent to the board, whose watcher prints it."""
        log.info(message)
        if self.board is not None and self.rank == 0:
            self.handler.sent = self.board.say.remote(message)

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
