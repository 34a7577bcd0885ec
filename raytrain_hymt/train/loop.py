"""The per-worker function: the only code that runs on Ray Train workers.

Data position: the pipeline fixes the row order and each epoch's batches are seeded by the epoch
(:mod:`~raytrain_hymt.data.epochs`), so the position is the epoch and the number of global batches
consumed in it (``RunState.batch_in_epoch``); a resumed run skips that many global batches, without
fetching the windows they came from, and trains exactly the rows an uninterrupted run would have
trained next. Each rank fetches only its own rows of every batch (:mod:`~raytrain_hymt.data.blocks`).
One step of the loop is :meth:`~raytrain_hymt.train.worker.Worker.train_step`; this module adds validation,
BLEU, logging, progress and checkpoints around it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from raytrain_hymt.data.epochs import rank_example_ids
from raytrain_hymt.train.distributed import all_reduce_sum
from raytrain_hymt.train.worker import LoopInputs, Worker

log = logging.getLogger("raytrain_hymt")

#: Rank 0's metric of how long the workers took to export the model (seconds), logged at the last step.
EXPORT_SECONDS = "export/seconds"
#: The step this submission started from, in every report to Ray Train: the driver's summary counts from it.
STARTED_AT = "started_at"


@dataclass
class Position:
    """Where the run is: what a checkpoint records besides the shards (``checkpoint.RunState``)."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    skipped_steps: int = 0
    generation: int = 0
    started: int = 0
    """The step this submission started from (``RunState.submission_start``)."""


def train_loop(loop_config: dict) -> None:
    """Ray Train entry point (``TorchTrainer(train_loop, train_loop_config=...)``)."""
    import ray.train

    from raytrain_hymt.data.blocks import RowFetcher
    from raytrain_hymt.data.epochs import batches, rank_lanes, window_rows
    from raytrain_hymt.errors import DataSourceError
    from raytrain_hymt.console.progress import Publisher
    from raytrain_hymt.console.quiet import quiet_ray

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_ray()
    inputs = LoopInputs(**loop_config)
    context = ray.train.get_context()
    w = Worker(inputs, context.get_world_rank(), context.get_world_size())
    progress = Publisher(inputs.progress_board, w.rank)  # before restore(): its warnings reach the console
    w.build()
    cfg = w.cfg
    state = w.restore()
    at = Position(*(state.step, state.epoch, state.batch_in_epoch, state.skipped_steps, state.generation)
                  if state else ())
    if state is not None and state.submission == inputs.submission:  # a restart within this submission
        at.started = state.submission_start
    elif state is not None:
        at.started = state.step
        if w.rank == 0:
            progress.note(f"resuming from {w.resumed_from} (step {state.step} of {w.total_steps})")
    tracker = rank0_tracker(w)
    try:
        tracker.log_dict(w.ds_config, "deepspeed_config.json")  # the resolved one, "auto" values filled in
        if w.rank == 0:
            log.info("training %d steps (%d per epoch) on %d workers, global batch %d rows%s",
                     w.total_steps, w.per_epoch, w.world, w.global_rows,
                     f", resuming after step {at.step} (epoch {at.epoch}, skipping {at.batch_in_epoch} batches)"
                     if state else "")
        fetch = RowFetcher(inputs.train_blocks)
        if fetch.total_rows != inputs.train_rows:  # the step count was planned from train_rows
            raise DataSourceError(f"the training blocks hold {fetch.total_rows} rows but the data statistics "
                                  f"count {inputs.train_rows}: the dataset changed after it was counted")
        window = window_rows(cfg.data.epoch_shuffle_rows, w.global_rows)
        lanes = rank_lanes(w.rank, w.world, w.accum, cfg.optim.micro_batch_size)
        steps = StepHandler(w, tracker, progress, fetch)
        for at.epoch, index, rows in batches(fetch, inputs.train_rows, window, w.global_rows, lanes,
                                             cfg.data.seed, at.epoch, at.batch_in_epoch):
            at.batch_in_epoch = index + 1
            steps.run(rows, at)
            if at.step >= w.total_steps:
                break
        if cfg.run.export:
            started = time.perf_counter()
            w.export()
            # A metric, not only the console line: the benchmarks read it from metrics.jsonl.
            tracker.log_metrics({EXPORT_SECONDS: time.perf_counter() - started}, step=at.step)
    finally:
        # Flush rank 0's queued metrics and close its files on every path, failures included.
        tracker.close()
        progress.close()
        if w.rank == 0:
            w.publish_local_files()


def rank0_tracker(w: Worker):
    """Rank 0's tracker of the run's MLflow run (metrics.jsonl, TensorBoard); the others a no-op one."""
    from raytrain_hymt.tracking.tracker import LocalTracker, make_tracker

    cfg, inputs = w.cfg, w.inputs
    if w.rank == 0 and not cfg.tracking.enabled:
        return LocalTracker(inputs.run_dir, cfg.tracking.tensorboard)
    return make_tracker(
        w.rank == 0 and cfg.tracking.enabled and inputs.tracking_uri is not None,  # rank 0 logs even if the server is down
        tracking_uri=inputs.tracking_uri, experiment=cfg.tracking.experiment, run_name=cfg.run.name or "",
        run_id=inputs.tracking_run_id, run_key=inputs.tracking_run_key, local_dir=inputs.run_dir,
        tensorboard=cfg.tracking.tensorboard,
        retry_interval_s=cfg.tracking.retry_interval_s,
    )


class StepHandler:
    """Everything one global step does around ``Worker.train_step``: fault hooks, validation, BLEU,
    metrics, the console line, progress and the checkpoint report."""

    def __init__(self, w: Worker, tracker, progress, fetch):
        """``fetch``: the rank's ``data.blocks.RowFetcher``, whose counts the test record shows."""
        from raytrain_hymt.evaluation.during_training import TrainingSample

        self.w, self.tracker, self.progress, self.fetch = w, tracker, progress, fetch
        cfg = w.cfg
        self.sample = TrainingSample(cfg, w.tokenizer, w.rank, w.inputs.run_dir) if cfg.eval.bleu_every_steps else None
        self.console_every = max(cfg.tracking.log_every_steps, w.total_steps // 10)
        self.val_loss: float | None = None

    def run(self, rows: dict, at: Position) -> None:
        """Train this rank's ``rows`` of step ``at.step + 1``, measure and record it; ``at`` moves on to it."""
        from raytrain_hymt.train import faults

        w, cfg = self.w, self.w.cfg
        faults.before_step(at.step + 1, w.rank)
        with faults.nan_loss(w.engine.module, at.step + 1, w.rank), faults.watch_layers(w.engine.module) as layers:
            metrics = w.train_step(rows)
        at.step += 1
        step, last = at.step, at.step >= w.total_steps
        skipped = bool(metrics.pop("train/skipped"))
        at.skipped_steps += skipped
        metrics["train/skipped_steps"] = at.skipped_steps
        faults.record_step(w.rank, step, lambda: rank_example_ids(rows), metrics["train/loss"], skipped,
                           w.engine.module, layers, self.fetch.counts())
        if skipped and w.rank == 0:
            log.warning("step %d: loss %s, gradient norm %s: update skipped (%d skipped so far)",
                        step, metrics["train/loss"], metrics["train/grad_norm"], at.skipped_steps)
        if step % cfg.eval.every_steps == 0 or last:
            self.val_loss = w.validate()
            if self.val_loss is not None:
                metrics["val/loss"] = self.val_loss
        if self.sample is not None and self.sample.due(step):  # every rank: generation may be collective
            metrics.update(self.sample.run(w.engine.module, step, self.tracker))
        validated = "val/loss" in metrics
        if step % cfg.tracking.log_every_steps == 0 or any(k.startswith("val/") for k in metrics):
            self.tracker.log_metrics(metrics, step=step)
        self.progress.step(step=step, total=w.total_steps, loss=metrics["train/loss"], lr=metrics["train/lr"],
                           tokens_per_s=metrics["train/tokens_per_s_per_worker"], console_every=self.console_every,
                           val_loss=self.val_loss if validated else None,
                           scores={f"BLEU {k.split('/')[2]}": v for k, v in metrics.items() if k.endswith("/bleu")})
        # The console gets about ten progress lines a run (MLflow gets every logged step).
        if w.rank == 0 and (step == 1 or step % self.console_every == 0 or validated or last):
            log.info(console_line(metrics, step, w.total_steps))
        self.report(metrics, at, checkpoint=step % cfg.checkpoint.every_steps == 0 or last)

    def report(self, metrics: dict, at: Position, checkpoint: bool) -> None:
        """Report the step to Ray Train: with a checkpoint (every rank saves its shard), or, after a
        validation, without one: Tune's ASHA (``hymt tune``) compares trials on every validation."""
        import ray.train

        from raytrain_hymt.train.checkpoint import RunState, checkpoint_dir_name, save_rank_checkpoint, step_tag

        w, cfg = self.w, self.w.cfg
        report = {"step": at.step, "train_loss": metrics["train/loss"], STARTED_AT: at.started}
        if "val/loss" in metrics:  # only this step's: an older validation would mislead ASHA
            report["val_loss"] = self.val_loss
        if not checkpoint:
            if "val/loss" in metrics:  # every rank validated at this step, so every rank reports (a barrier)
                ray.train.report(report)
            return
        state = RunState(step=at.step, epoch=at.epoch, batch_in_epoch=at.batch_in_epoch, world_size=w.world,
                         tag=step_tag(at.step), zero_stage=cfg.deepspeed.zero_stage,
                         tracking_run_id=w.inputs.tracking_run_id, skipped_steps=at.skipped_steps,
                         global_rows=w.global_rows, generation=at.generation, precision=cfg.deepspeed.precision,
                         base_model=w.base_model, data_fingerprint=w.inputs.data_fingerprint,
                         submission=w.inputs.submission, submission_start=at.started)
        folder = save_rank_checkpoint(w.engine, state, w.rank, w.tokenizer)
        upload = (ray.train.CheckpointUploadMode.ASYNC if cfg.checkpoint.async_upload
                  else ray.train.CheckpointUploadMode.SYNC)
        ray.train.report({**report, "skipped_steps": at.skipped_steps},
                         checkpoint=ray.train.Checkpoint.from_directory(folder),
                         checkpoint_dir_name=checkpoint_dir_name(at.step, at.generation),
                         checkpoint_upload_mode=upload, delete_local_checkpoint_after_upload=True)
        # Ray Train keeps a checkpoint only once its controller has collected every rank's report, which
        # it does when it next polls the workers (every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default).
        # A rank that died before that poll, even after handing its report over, lost the whole checkpoint:
        # a resume from step 0 instead of 6 (rank 1 raised 15 ms after its report), from step 2 instead
        # of 4 (rank 1 SIGKILLed one 0.2 s step later). So no rank goes on until the controller has
        # committed the checkpoint. An asynchronous upload is not waited for (that is its point): there,
        # every rank only waits until every rank has reported.
        if upload == ray.train.CheckpointUploadMode.SYNC:
            ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
        else:
            all_reduce_sum([0.0], w.device)


def console_line(metrics: dict, step: int, total: int) -> str:
    """Rank 0's progress line: ``step 3/60 loss 7.9808 val 7.9 lr 1.20e-03 grad 1.234 5678 tok/s/worker``."""
    val = f" val {metrics['val/loss']:.4f}" if "val/loss" in metrics else ""
    memory = ""
    if "train/memory_reserved_gib" in metrics:  # what the card must hold, peak so far
        memory = (f", GPU memory peak {metrics['train/memory_gib']:.1f} GiB allocated, "
                  f"{metrics['train/memory_reserved_gib']:.1f} reserved")
    return (f"step {step}/{total} loss {metrics['train/loss']:.4f}{val} lr {metrics['train/lr']:.2e} "
            f"grad {metrics['train/grad_norm']:.3f} {metrics['train/tokens_per_s_per_worker']:.0f} tok/s/worker{memory}")
