"""Ctrl-C: stop the run cleanly and tell the user where its last checkpoint is and how to resume.

Ray Train's ``fit()`` installs its own SIGINT handler (Ray 2.60, ``DataParallelTrainer.
_register_sigint_handler``): it aborts the controller, after which ``fit()`` returns (or the handler
exits the process with status 0), so no ``KeyboardInterrupt`` ever reaches the caller and the run would
go on to export a half-trained model. :func:`fit` wraps that handler to remember the interrupt and turns
the end of ``fit()`` into :class:`Interrupted`, which the command line reports in one line (exit 130).
"""

from __future__ import annotations

import signal
import threading


class Interrupted(KeyboardInterrupt):
    """The user interrupted run ``run``; ``checkpoint``: its newest checkpoint, None if there is none."""

    def __init__(self, run: str | None, checkpoint: str | None):
        super().__init__(run, checkpoint)
        self.run = run
        self.checkpoint = checkpoint


def latest_checkpoint(storage_path: str, name: str | None) -> str | None:
    """The newest ``checkpoint_step*`` folder of run ``name``, or None (no run, no checkpoint yet)."""
    import pyarrow.fs

    from raytrain_hymt.checkpoint import CHECKPOINT_DIR_RE
    from raytrain_hymt.storage import RunFolder

    if not name:
        return None
    folder = RunFolder(storage_path, name, create=False)
    try:
        infos = folder.fs.get_file_info(pyarrow.fs.FileSelector(folder.path, allow_not_found=True))
    except OSError:
        return None
    found = []
    for info in infos:
        m = CHECKPOINT_DIR_RE.match(info.base_name)
        if m and info.type == pyarrow.fs.FileType.Directory:
            found.append(((int(m.group(1)), int(m.group(2) or 0)), info.base_name))
    return f"{folder.uri}/{max(found)[1]}" if found else None


def fit(trainer, storage_path: str, name: str):
    """``trainer.fit()``; a Ctrl-C during it aborts the run as Ray does, then raises :class:`Interrupted`."""
    interrupts: list[int] = []
    register = getattr(trainer, "_register_sigint_handler", None)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main_thread else None

    def register_and_wrap(controller):
        register(controller)
        ray_handler = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):
            interrupts.append(signum)
            if callable(ray_handler):
                ray_handler(signum, frame)

        signal.signal(signal.SIGINT, on_sigint)

    if register is not None:
        trainer._register_sigint_handler = register_and_wrap
    try:
        result = trainer.fit()
    except (Exception, SystemExit):  # Ray's handler may sys.exit(0) or the aborted run end with an error
        if interrupts:
            raise Interrupted(name, latest_checkpoint(storage_path, name)) from None
        raise
    finally:
        if main_thread and previous is not None:  # Ray's handler would abort a controller that is gone
            signal.signal(signal.SIGINT, previous)
    if interrupts:
        fallback = result.checkpoint.path if result.checkpoint else None
        raise Interrupted(name, latest_checkpoint(storage_path, name) or fallback)
    return result
