"""The per-worker function: the only code that runs on Ray Train workers.

Every worker reads the whole ordered row stream and takes its own slice of each global batch of
``world × grad_accum × micro_batch`` rows (``rank_slice``): the same rows form global step k whatever
the worker count, and a restarted run resumes exactly after the last checkpointed step by skipping
``batch_in_epoch`` global batches. The loss of a step is the sum of token losses over the whole global
batch divided by its target-token count (one all-reduce), so any split over workers and micro-steps
gives the same gradients.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from raytrain_hymt.config import Config
from raytrain_hymt.errors import NonFiniteError

log = logging.getLogger("raytrain_hymt")

#: Names inside a run folder written by the workers: the exported model, rank 0's metric copies.
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


@dataclass
class LoopInputs:
    """What the driver hands every worker besides the datasets."""

    config: dict
    train_rows: int
    tracking_run_id: str | None
    tracking_uri: str | None
    run_dir: str
    data_fingerprint: dict | None = None
    progress_board: str | None = None
    """Name of the driver's progress actor (``progress.py``): rank 0 publishes every step there."""
    tracking_run_key: str | None = None
    """The job's MLflow key (``run.json``): rank 0 finds or creates the run by it while its id is unknown."""


def rank_slice(global_batch: dict[str, np.ndarray], micro: int, rank: int, world: int, micro_batch: int) -> dict:
    """Rows of ``global_batch`` that ``rank`` trains on in micro-step ``micro``.

    Layout: micro-step a of rank r takes rows ``[(a·world + r)·b, (a·world + r + 1)·b)``, so with one
    micro-step per optimizer step rank r holds the r-th contiguous block of the global batch.
    """
    start = (micro * world + rank) * micro_batch
    return {k: v[start : start + micro_batch] for k, v in global_batch.items()}


def steps_per_epoch(train_rows: int, world: int, grad_accum: int, micro_batch: int) -> int:
    """Optimizer steps in one pass (the incomplete last global batch is dropped on every rank alike)."""
    return train_rows // (world * grad_accum * micro_batch)


def _setup_environment(use_gpu: bool) -> torch.device:
    if not use_gpu:
        # Must precede the first `import deepspeed`: it picks its accelerator once, at import.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _all_reduce_sum(values: list[float], device) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _nonfinite_ranks(value: float, rank: int, world: int, device) -> list[int]:
    """Ranks whose ``value`` is NaN or infinite (one all-reduce, so every rank gets the same answer)."""
    import math

    flags = [0.0] * world
    flags[rank] = 0.0 if math.isfinite(value) else 1.0
    return [r for r, f in enumerate(_all_reduce_sum(flags, device)) if f]


def _drop_nonfinite_grads(module, device) -> bool:
    """ZeRO stage 0 in fp32 has no overflow check: drop the gradients when their norm is not finite.

    torch's AdamW leaves a parameter without ``.grad`` untouched, so the step that follows changes
    nothing. Returns whether the gradients were dropped (the same on every rank).
    """
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    local = float(torch.stack([g.detach().float().norm() for g in grads]).norm()) if grads else 0.0
    (bad,) = _all_reduce_sum([0.0 if np.isfinite(local) else 1.0], device)
    if bad:
        for p in module.parameters():
            p.grad = None
    return bool(bad)


def _memory_gib(device) -> dict[str, float]:
    """Peak memory so far: on a GPU allocated and reserved (what the card must hold), on a CPU the RSS."""
    if device.type == "cuda":
        return {"train/memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "train/memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    import psutil

    return {"train/memory_gib": psutil.Process().memory_info().rss / 2**30}


def _forward_loss(engine, batch: dict, fused: bool = False) -> torch.Tensor:
    from raytrain_hymt.data.packing import token_loss_sum

    if fused:  # model.use_fused_loss: the model returns the summed token loss itself
        return engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                      attention_mask=batch["attention_mask"], labels=batch["labels"], use_cache=False)
    out = engine(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
        use_cache=False,
    )
    loss_sum, _ = token_loss_sum(out.logits, batch["labels"])
    return loss_sum


class Worker:
    """State of one training worker: model engine, data position, tracker."""

    def __init__(self, inputs: LoopInputs, context=None):
        """``context``: anything with ``get_world_rank()``/``get_world_size()``; default Ray Train's own
        (the benchmark's torchrun mode passes a stand-in to run the same code without Ray)."""
        self.cfg = Config.model_validate(inputs.config)
        self.inputs = inputs
        self.device = _setup_environment(self.cfg.scaling.use_gpu)
        if context is None:
            import ray.train

            context = ray.train.get_context()
        ctx = context
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        opt = self.cfg.optim
        self.per_epoch = steps_per_epoch(inputs.train_rows, self.world, opt.grad_accum, opt.micro_batch_size)
        if self.per_epoch == 0:
            raise ValueError(
                f"{inputs.train_rows} training rows are fewer than one global batch "
                f"({self.world} workers × {opt.grad_accum} accumulation × {opt.micro_batch_size} rows)"
            )
        self.total_steps = opt.max_steps or opt.epochs * self.per_epoch
        self.global_rows = self.world * opt.grad_accum * opt.micro_batch_size

    def build(self) -> None:
        from raytrain_hymt.checkpoint import base_identity
        from raytrain_hymt.engine import initialize_engine
        from raytrain_hymt.metrics import matmul_params, peak_flops
        from raytrain_hymt.model import load_model, load_tokenizer, use_fused_loss

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path, cfg.model.trust_remote_code)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.deepspeed.precision]
        model = load_model(
            cfg.model.name_or_path, self.tokenizer, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code, seed=cfg.run.seed, device=self.device,
        )
        if cfg.model.fused_loss:
            use_fused_loss(model)
        if cfg.model.compile:
            for layer in model.get_decoder().layers:
                layer.compile()
        self.engine, self.ds_config = initialize_engine(
            model, cfg, self.world, self.total_steps, on_gpu=self.device.type == "cuda"
        )
        # from_pretrained returns a model in eval mode, where transformers skips activation checkpointing
        # and dropout: every model source trains in train mode from the first step.
        self.engine.train()
        self.base_model = base_identity(cfg.model.name_or_path, cfg.run.seed) if cfg.lora.enabled else None
        if self.rank == 0:
            trainable = sum(p.numel() for p in self.engine.module.parameters() if p.requires_grad)
            log.info("ZeRO-%d, %s, trainable parameters: %s (LoRA %s)", cfg.deepspeed.zero_stage,
                     cfg.deepspeed.precision, f"{trainable:,}", "on" if cfg.lora.enabled else "off")
        mc = model.config
        self.shape = (matmul_params(model), mc.num_hidden_layers, mc.num_attention_heads,
                      getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
        self.trainable_matmul_params = matmul_params(model, trainable_only=True)  # LoRA: the adapters only
        self.peak = peak_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        self.mask_dtype = dtype if self.device.type == "cuda" else torch.float32
        # DeepSpeed's ZeRO and bf16/fp16 optimizers discard a step with a non-finite gradient norm; plain
        # fp32 data parallel (stage 0) does not, so train_step checks it (_drop_nonfinite_grads).
        self._unguarded = cfg.deepspeed.zero_stage == 0 and cfg.deepspeed.precision == "fp32"

    def collate(self, rows: dict) -> dict:
        from raytrain_hymt.data.packing import collate

        data, attn = self.cfg.data, self.cfg.model.attn_implementation
        # Flex attention compiles its kernels per shape: packed rows padded to one fixed length keep it
        # from recompiling at every new row length.
        pad_to = data.pack_tokens if data.packing and attn == "flex_attention" else None
        return collate(
            rows, pad_token_id=self.tokenizer.pad_token_id, attn_implementation=attn,
            mask_dtype=self.mask_dtype, device=self.device, pad_to=pad_to,
        )

    def restore(self):
        """Resume from the newest whole checkpoint of this run, if any: ``RunState`` or None.

        Ray hands over only its latest checkpoint; when that one was cut off mid-write (a marker missing,
        a file short: ``check_checkpoint``) or DeepSpeed cannot load it, the older ones in the run folder
        are tried, newest first, with a warning that says why. Every rank decides alike (the checks read
        the same storage; a load error on any rank is shared by an all-reduce).
        """
        import ray.train

        from raytrain_hymt.checkpoint import (
            IncompleteCheckpointError,
            check_base_model,
            check_checkpoint,
            check_same_shape,
            next_generation,
            older_checkpoints,
            restore_rank,
        )

        latest = ray.train.get_checkpoint()
        if latest is None:
            return None
        fs = latest.filesystem
        rejected = []
        for path in [latest.path, *older_checkpoints(fs, latest.path)]:
            try:
                saved = check_checkpoint(fs, path)
            except IncompleteCheckpointError as e:
                rejected.append(str(e))
                if self.rank == 0:
                    log.warning("not resuming from %s", e)
                continue
            check_same_shape(saved, self.world, self.global_rows, self.cfg.deepspeed.zero_stage)
            if self.base_model is not None:
                check_base_model(saved.base_model, f"resuming from {path}", self.cfg.model.name_or_path,
                                 self.cfg.run.seed)
            error = None
            try:
                with ray.train.Checkpoint(path, filesystem=fs).as_directory() as folder:
                    state = restore_rank(self.engine, folder, self.rank)
            except Exception as e:  # noqa: BLE001 - a shard whole in size but not in content
                from raytrain_hymt.checkpoint import unreadable_file

                error = f"{path}: DeepSpeed could not load it on rank {self.rank}: {unreadable_file(fs, path, e)}"
                log.warning("not resuming from %s", error)
            (failed_ranks,) = _all_reduce_sum([1.0 if error else 0.0], self.device)
            if not failed_ranks:
                if self.rank == 0:
                    log.info("resumed from %s at step %d", path, state.step)
                if path != latest.path:
                    state.generation = next_generation(fs, path.rstrip("/").rsplit("/", 1)[0])
                self.engine.train()  # as after build: a restored run trains exactly like an uninterrupted one
                return state
            rejected.append(error or f"{path}: {int(failed_ranks)} rank(s) could not load it")
        raise IncompleteCheckpointError(
            "no usable checkpoint to resume from:\n  " + "\n  ".join(rejected)
            + "\nremove the run folder's checkpoint_step* folders (or use a new run name) to start over"
        )

    def train_step(self, global_batch: dict) -> dict[str, float]:
        """One optimizer step over this rank's share of ``global_batch``; returns the step's metrics."""
        from raytrain_hymt.metrics import mfu, step_flops

        opt = self.cfg.optim
        t0 = time.perf_counter()
        micro = [self.collate(rank_slice(global_batch, a, self.rank, self.world, opt.micro_batch_size))
                 for a in range(opt.grad_accum)]
        local_targets = float(sum(int(m["num_target_tokens"]) for m in micro))
        local_tokens = float(sum(int(s.sum()) for m in micro for s in m["seq_lens"]))
        # FLOPs are linear in the documents, so the global count is the sum of every rank's own.
        local_flops = step_flops(*self.shape, (int(n) for m in micro for s in m["seq_lens"] for n in s),
                                 trainable_params=self.trainable_matmul_params)
        global_targets, global_tokens, flops = _all_reduce_sum([local_targets, local_tokens, local_flops], self.device)
        scale = self.world / max(global_targets, 1.0)
        lr = self.engine.get_lr()[0]  # the rate this step applies (the scheduler moves on inside step())
        loss_total = 0.0
        bad_ranks: list[int] = []
        for index, m in enumerate(micro):
            loss_sum = _forward_loss(self.engine, m, self.cfg.model.fused_loss)
            loss_value = float(loss_sum.detach())
            # Checked on every rank alike before backward: a fail stops here, a skip lets the NaN reach the
            # gradients, whose non-finite norm makes the optimizer discard the update (checked below).
            bad_ranks = bad_ranks or _nonfinite_ranks(loss_value, self.rank, self.world, self.device)
            if bad_ranks and self.cfg.checkpoint.on_nonfinite == "fail":
                raise NonFiniteError(f"non-finite training loss at step {self.engine.global_steps + 1} on rank(s) "
                                     f"{bad_ranks} (checkpoint.on_nonfinite=fail; 'skip' drops such steps)")
            # DeepSpeed averages over ranks; scaling by world / global targets makes the result the mean
            # over every target token of the global step. scale_wrt_gas=False: no extra 1/accum.
            self.engine.backward(loss_sum * scale, scale_wrt_gas=False)
            dropped = index == len(micro) - 1 and self._unguarded and _drop_nonfinite_grads(self.engine.module, self.device)
            self.engine.step()
            loss_total += loss_value
        skipped = dropped or not self.engine.was_step_applied()
        if bad_ranks and not skipped:
            raise NonFiniteError("DeepSpeed applied an update from a non-finite loss; the weights are no longer valid")
        if skipped and self.cfg.checkpoint.on_nonfinite == "fail" and self.cfg.deepspeed.precision != "fp16":
            raise NonFiniteError(f"non-finite gradient norm at step {self.engine.global_steps}: the update was "
                                 "discarded (checkpoint.on_nonfinite=fail; 'skip' drops such steps)")
        (loss_global,) = _all_reduce_sum([loss_total], self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        grad_norm = self.engine.get_global_grad_norm()
        metrics = {
            "train/loss": loss_global / max(global_targets, 1.0),
            "train/lr": lr,
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/tokens_per_s_per_worker": global_tokens / seconds / self.world,
            "train/target_tokens": global_targets,
            "train/step_time_s": seconds,
            **_memory_gib(self.device),
            "train/skipped": float(skipped),
        }
        util = mfu(flops, seconds, self.world, self.peak)
        if util is not None:
            metrics["train/mfu"] = util
        return metrics

    @torch.no_grad()
    def validate(self) -> float | None:
        """Mean token loss over the whole validation set (every rank evaluates its slice); None when the
        validation set is empty (``data.val_fraction: 0``), so no one mistakes 0 for a perfect model."""
        import ray.train

        from raytrain_hymt.data.packing import token_loss_sum

        shard = ray.train.get_dataset_shard("val")
        self.engine.eval()
        b = self.cfg.optim.micro_batch_size
        loss, tokens = 0.0, 0.0
        for batch in shard.iter_batches(batch_size=self.world * b, batch_format="numpy"):
            rows = rank_slice(batch, 0, self.rank, self.world, b)
            # Under ZeRO-3 a forward is collective: a rank without rows still runs one (on row 0, ignored).
            use = rows if len(rows["input_ids"]) else {k: v[:1] for k, v in batch.items()}
            m = self.collate(use)
            out = self.engine(input_ids=m["input_ids"], position_ids=m["position_ids"],
                              attention_mask=m["attention_mask"], use_cache=False)
            s, n = token_loss_sum(out.logits, m["labels"])
            if len(rows["input_ids"]):
                loss, tokens = loss + float(s), tokens + float(n)
        self.engine.train()
        total_loss, total_tokens = _all_reduce_sum([loss, tokens], self.device)
        return total_loss / total_tokens if total_tokens else None


    def export(self) -> str | None:
        """Write the trained model to ``<run folder>/model`` from the workers (every rank takes part; rank
        0 writes and returns where it is), and for LoRA the adapters alone to ``<run folder>/adapter``.
        The driver never loads the weights."""
        from raytrain_hymt.export import export_from_engine
        from raytrain_hymt.storage import RunFolder

        cfg = self.cfg
        dtype = torch.float32 if cfg.deepspeed.precision == "fp32" else torch.bfloat16
        t0 = time.perf_counter()
        folder = RunFolder(cfg.run.storage_path, cfg.run.name, create=False)
        adapter = folder.location(ADAPTER_DIR) if cfg.lora.enabled else None
        where = export_from_engine(self.engine, self.tokenizer, folder.location(MODEL_DIR), dtype,
                                   cfg.run.export_shard_mb * 10**6, self.rank, adapter_out=adapter)
        if self.rank == 0:
            log.info("exported the model to %s in %.0f s", where, time.perf_counter() - t0)
        return where

    def publish_local_files(self) -> None:
        """On a URI storage root, copy rank 0's local ``metrics.jsonl`` and TensorBoard files into the run
        folder (on a local root they are written there already)."""
        from raytrain_hymt.storage import RunFolder, is_uri

        cfg = self.cfg
        if not is_uri(cfg.run.storage_path):
            return
        folder = RunFolder(cfg.run.storage_path, cfg.run.name, create=False)
        for name in (METRICS_FILE, TENSORBOARD_DIR):
            try:
                folder.push(name, source=Path(self.inputs.run_dir) / name)
            except Exception as e:  # noqa: BLE001 - the run's result does not depend on its log copy
                log.warning("could not copy %s to %s: %s", name, folder.uri, e)


def _rank_example_ids(global_batch: dict, rank: int, world: int, grad_accum: int, micro_batch: int) -> list[int]:
    """Example ids of the rows ``rank`` trains on in ``global_batch`` (every micro-step's slice)."""
    return [int(e) for a in range(grad_accum)
            for row in rank_slice(global_batch, a, rank, world, micro_batch)["example_ids"] for e in row]


def train_loop(loop_config: dict) -> None:
    """Ray Train entry point (``TorchTrainer(train_loop, train_loop_config=...)``).

    Data position: the pipeline fixes the row order and each epoch's permutation is seeded by the epoch
    (``raytrain_hymt.data.epochs``), so the position is the epoch and the number of global batches consumed in it
    (``RunState.batch_in_epoch``); a resumed run skips that many global batches and trains exactly the
    rows an uninterrupted run would have trained next.
    """
    import ray.train

    from raytrain_hymt import faults
    from raytrain_hymt.checkpoint import RunState, checkpoint_dir_name, save_rank_checkpoint, step_tag
    from raytrain_hymt.data.epochs import epoch_batches, window_rows
    from raytrain_hymt.progress import Publisher
    from raytrain_hymt.train_bleu import TrainingSample
    from raytrain_hymt.quiet import quiet_ray
    from raytrain_hymt.tracking import make_tracker

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_ray()
    inputs = LoopInputs(**loop_config)
    w = Worker(inputs)
    progress = Publisher(inputs.progress_board, w.rank)  # before restore(): its warnings reach the console
    w.build()
    cfg = w.cfg
    state = w.restore()
    step = state.step if state else 0
    epoch = state.epoch if state else 0
    skip = state.batch_in_epoch if state else 0
    skipped_steps = state.skipped_steps if state else 0
    generation = state.generation if state else 0
    tracker = make_tracker(
        w.rank == 0 and cfg.tracking.enabled and inputs.tracking_uri is not None,  # rank 0 logs even if the server is down
        tracking_uri=inputs.tracking_uri, experiment=cfg.tracking.experiment, run_name=cfg.run.name or "",
        run_id=inputs.tracking_run_id, run_key=inputs.tracking_run_key, local_dir=inputs.run_dir,
        tensorboard=cfg.tracking.tensorboard,
        retry_interval_s=cfg.tracking.retry_interval_s,
    )
    sample = TrainingSample(cfg, w.tokenizer, w.rank, inputs.run_dir) if cfg.eval.bleu_every_steps else None
    try:
        tracker.log_dict(w.ds_config, "deepspeed_config.json")  # the resolved one, "auto" values filled in
        train = ray.train.get_dataset_shard("train")
        opt = cfg.optim
        global_rows = w.global_rows
        upload = ray.train.CheckpointUploadMode.ASYNC if cfg.checkpoint.async_upload else ray.train.CheckpointUploadMode.SYNC
        if w.rank == 0:
            log.info("training %d steps (%d per epoch) on %d workers, global batch %d rows%s",
                     w.total_steps, w.per_epoch, w.world, global_rows,
                     f", resuming after step {step} (epoch {epoch}, skipping {skip} batches)" if state else "")
        val_loss = None
        console_every = max(cfg.tracking.log_every_steps, w.total_steps // 10)
        while step < w.total_steps:
            windows = train.iter_batches(batch_size=window_rows(cfg.data.epoch_shuffle_rows, global_rows),
                                         batch_format="numpy", prefetch_batches=1)
            batches = epoch_batches(windows, cfg.data.seed, epoch, global_rows)  # a new order every epoch
            for index, global_batch in enumerate(batches):
                if index < skip:
                    continue
                faults.before_step(step + 1, w.rank)
                with faults.nan_loss(w.engine.module, step + 1, w.rank), faults.watch_layers(w.engine.module) as layers:
                    metrics = w.train_step(global_batch)
                step += 1
                skipped = bool(metrics.pop("train/skipped"))
                skipped_steps += skipped
                metrics["train/skipped_steps"] = skipped_steps
                faults.record_step(w.rank, step, _rank_example_ids(global_batch, w.rank, w.world, opt.grad_accum,
                                   opt.micro_batch_size), metrics["train/loss"], skipped, w.engine.module, layers)
                if skipped and w.rank == 0:
                    log.warning("step %d: loss %s, gradient norm %s: update skipped (%d skipped so far)",
                                step, metrics["train/loss"], metrics["train/grad_norm"], skipped_steps)
                last = step >= w.total_steps
                if step % cfg.eval.every_steps == 0 or last:
                    val_loss = w.validate()
                    if val_loss is not None:
                        metrics["val/loss"] = val_loss
                if sample is not None and sample.due(step):  # every rank: generation may be collective
                    metrics.update(sample.run(w.engine.module, step, tracker))
                if step % cfg.tracking.log_every_steps == 0 or any(k.startswith("val/") for k in metrics):
                    tracker.log_metrics(metrics, step=step)
                progress.step(step=step, total=w.total_steps, loss=metrics["train/loss"], lr=metrics["train/lr"],
                              tokens_per_s=metrics["train/tokens_per_s_per_worker"], console_every=console_every,
                              val_loss=val_loss if "val/loss" in metrics else None,
                              scores={f"BLEU {k.split('/')[2]}": v for k, v in metrics.items() if k.endswith("/bleu")})
                # The console gets about ten progress lines a run (MLflow gets every logged step).
                if w.rank == 0 and (step == 1 or step % console_every == 0 or "val/loss" in metrics or last):
                    val = f" val {val_loss:.4f}" if "val/loss" in metrics else ""
                    memory = ""
                    if "train/memory_reserved_gib" in metrics:  # what the card must hold, peak so far
                        memory = (f", GPU memory peak {metrics['train/memory_gib']:.1f} GiB allocated, "
                                  f"{metrics['train/memory_reserved_gib']:.1f} reserved")
                    log.info("step %d/%d loss %.4f%s lr %.2e grad %.3f %.0f tok/s/worker%s", step, w.total_steps,
                             metrics["train/loss"], val, metrics["train/lr"], metrics["train/grad_norm"],
                             metrics["train/tokens_per_s_per_worker"], memory)
                if step % cfg.checkpoint.every_steps == 0 or last:
                    run_state = RunState(step=step, epoch=epoch, batch_in_epoch=index + 1, world_size=w.world,
                                         tag=step_tag(step), zero_stage=cfg.deepspeed.zero_stage,
                                         tracking_run_id=inputs.tracking_run_id, skipped_steps=skipped_steps,
                                         global_rows=global_rows, generation=generation,
                                         precision=cfg.deepspeed.precision, base_model=w.base_model,
                                         data_fingerprint=inputs.data_fingerprint)
                    folder = save_rank_checkpoint(w.engine, run_state, w.rank, w.tokenizer)
                    report = {"step": step, "train_loss": metrics["train/loss"], "skipped_steps": skipped_steps}
                    if "val/loss" in metrics:  # only this step's: an older validation would mislead ASHA
                        report["val_loss"] = val_loss
                    ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder),
                                     checkpoint_dir_name=checkpoint_dir_name(step, generation),
                                     checkpoint_upload_mode=upload,
                                     delete_local_checkpoint_after_upload=True)
                elif "val/loss" in metrics:
                    # Every validation reaches the driver: Tune's ASHA (hymt tune) compares trials on it.
                    # Every rank validated at this step, so every rank reports (report() is a barrier).
                    ray.train.report({"step": step, "train_loss": metrics["train/loss"], "val_loss": val_loss})
                if step >= w.total_steps:
                    break
            else:
                epoch, skip = epoch + 1, 0
                continue
            break
        if cfg.run.export:
            w.export()
    finally:
        # Flush rank 0's queued metrics and close its files on every path, failures included.
        tracker.close()
        progress.close()
        if w.rank == 0:
            w.publish_local_files()
