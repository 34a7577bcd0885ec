"""Keep the console readable: the project's lines and training's one progress bar; Ray's, DeepSpeed's, MLflow's and
transformers' internals off at default verbosity. ``HYMT_VERBOSE=1`` brings all of them back.

What goes, and how:

* every worker's forwarded output (``TrainingReport(...)`` per rank, DeepSpeed's op-build lines, Ray
  Train's controller chatter): ``ray.init(log_to_driver=False)`` (:func:`ray_init_kwargs`). It stays in Ray's
  log files (``/tmp/ray/session_latest/logs``); rank 0 publishes its progress and warnings to the driver
  instead (``console.progress``);
* Python loggers other than the project's below WARNING, and Ray's own warnings on the driver;
* Ray Data's bars, global and per operator (data preparation logs one line per stage instead);
* DeepSpeed's "Setting accelerator to CPU" warning on a driver without GPUs (it picks the CPU anyway), also
  where ``hymt translate`` loads a checkpoint without Ray (:func:`quiet_deepspeed`);
* MLflow's INFO lines (its store's set-up), also when mlflow is imported later;
* Ray Tune's status tables, trial configs and results, header and TensorBoard hint (:func:`quiet_tune`);
* transformers' shard-loading and shard-writing bars, and DeepSpeed's at export (:func:`no_bars`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys

NOISY_LOGGERS = ("ray.data", "ray.train", "ray.tune", "deepspeed", "DeepSpeed", "torch.distributed")
PROJECT_LOGGER = "raytrain_hymt"


def verbose() -> bool:
    """Whether ``HYMT_VERBOSE`` asks for everything."""
    return bool(os.environ.get("HYMT_VERBOSE"))


def ray_init_kwargs() -> dict:
    """``ray.init``'s console settings: workers' output forwarded and Ray's INFO lines only when verbose."""
    return {"log_to_driver": verbose(), "logging_level": logging.INFO if verbose() else logging.ERROR}


@contextlib.contextmanager
def no_bars():
    """Whatever writes to ``sys.stderr`` inside is held back (DeepSpeed's zero_to_fp32 draws "Loading
    checkpoint shards" with a bare tqdm that no logging setting reaches) and shown only if the block
    fails. Logging handlers keep their own stream, so log lines still appear. Unchanged when verbose."""
    if verbose():
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise


class _ProjectOnly(logging.Filter):
    """Below WARNING only the project's own records pass (third-party INFO chatter stays out)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith(PROJECT_LOGGER)


def quiet_ray(driver: bool = False) -> None:
    """Silence progress bars and INFO logs of Ray Data / Ray Train / DeepSpeed (``HYMT_VERBOSE=1``: keep).

    Called at the start of every worker and, with ``driver``, on the driver before Ray starts.
    """
    if verbose():
        return
    import ray.data

    ctx = ray.data.DataContext.get_current()
    # Data preparation logs one line per stage in place of Ray Data's bars (data.pipeline, data.prepared).
    ctx.enable_progress_bars = False
    ctx.enable_operator_progress_bars = False
    ctx.print_on_execution_start = False
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _ProjectOnly) for f in handler.filters):
            handler.addFilter(_ProjectOnly())
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if driver:
        _quiet_driver()


def _quiet_driver() -> None:
    # Ray's driver-side warnings ("progress bars disabled") and MLflow's store setup lines are about
    # their internals, not the run (ray.init's logging_level covers Ray's own logger: ray_init_kwargs).
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # mlflow sets its logger's level from this when it is imported, which may come later ("Creating initial
    # MLflow database tables...").
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    quiet_deepspeed()


def quiet_deepspeed() -> None:
    """Name DeepSpeed's accelerator for this process before DeepSpeed is first imported: what it falls back to
    on a machine without a GPU, without its "Setting accelerator to CPU" warning. Unchanged when verbose or
    when ``DS_ACCELERATOR`` is set. Called on the driver (:func:`quiet_ray`) and by ``hymt translate`` of a
    checkpoint, which loads it with DeepSpeed in its own process, without Ray."""
    if verbose() or "DS_ACCELERATOR" in os.environ:
        return
    import torch

    from raytrain_hymt.config.schema import deepspeed_accelerator_env

    os.environ.update(deepspeed_accelerator_env(torch.cuda.is_available()))


def tune_verbosity() -> int:
    """``tune.RunConfig(verbose=...)``: 0 unless verbose, then 1 (Tune's default: its status table every 30 s,
    each trial's start, config and results). ``hymt tune`` logs one line per trial that ends instead."""
    return 1 if verbose() else 0


@contextlib.contextmanager
def quiet_tune():
    """Around ``Tuner.fit``: Tune's console off unless verbose. ``verbose=0`` alone leaves Ray 2.60's new
    output engine printing the experiment's header, its folder and the TensorBoard hint
    (``ray.tune.experimental.output``, whatever the verbosity); ``RAY_AIR_NEW_OUTPUT=0`` (Tune's switch back
    to its older reporter, read when ``fit`` starts) makes ``verbose=0`` print nothing."""
    if verbose():
        yield
        return
    saved = os.environ.get("RAY_AIR_NEW_OUTPUT")
    os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RAY_AIR_NEW_OUTPUT", None)
        else:
            os.environ["RAY_AIR_NEW_OUTPUT"] = saved
