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

import numpy as np
import torch

from raytrain_hymt.config import Config

log = logging.getLogger("raytrain_hymt")


@dataclass
class LoopInputs:
    """What the driver hands every worker besides the datasets."""

    config: dict
    train_rows: int
    tracking_run_id: str | None
    tracking_uri: str | None
    run_dir: str


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


def _memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _forward_loss(engine, batch: dict, device) -> torch.Tensor:
    from raytrain_hymt.data.packing import token_loss_sum

    out = engine(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
        use_cache=False,
    )
    loss_sum, _ = token_loss_sum(out.logits, batch["labels"])
    return loss_sum


class Worker:
    """State of one training worker: model engine, data position, tracker."""

    def __init__(self, inputs: LoopInputs):
        import ray.train

        self.cfg = Config.model_validate(inputs.config)
        self.inputs = inputs
        self.device = _setup_environment(self.cfg.scaling.use_gpu)
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        opt = self.cfg.optim
        self.per_epoch = steps_per_epoch(inputs.train_rows, self.world, opt.grad_accum, opt.micro_batch_size)
        if self.per_epoch == 0:
            raise ValueError(
                f"{inputs.train_rows} training rows are fewer than one global batch "
                f"({self.world} workers × {opt.grad_accum} accumulation × {opt.micro_batch_size} rows)"
            )
        self.total_steps = opt.max_steps or opt.epochs * self.per_epoch

    def build(self) -> None:
        from raytrain_hymt.engine import initialize_engine
        from raytrain_hymt.metrics import matmul_params, peak_flops
        from raytrain_hymt.model import load_model, load_tokenizer

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.name_or_path, cfg.model.trust_remote_code)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.deepspeed.precision]
        model = load_model(
            cfg.model.name_or_path, self.tokenizer, dtype=dtype, attn_implementation=cfg.model.attn_implementation,
            trust_remote_code=cfg.model.trust_remote_code, seed=cfg.run.seed,
        )
        self.engine, self.ds_config = initialize_engine(
            model, cfg, self.world, self.total_steps, on_gpu=self.device.type == "cuda"
        )
        mc = model.config
        self.shape = (matmul_params(model), mc.num_hidden_layers, mc.num_attention_heads,
                      getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
        self.peak = peak_flops(torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None)
        self.mask_dtype = dtype if self.device.type == "cuda" else torch.float32

    def collate(self, rows: dict) -> dict:
        from raytrain_hymt.data.packing import collate

        return collate(
            rows, pad_token_id=self.tokenizer.pad_token_id, attn_implementation=self.cfg.model.attn_implementation,
            mask_dtype=self.mask_dtype, device=self.device,
        )

    def restore(self):
        """Resume from the checkpoint Ray hands this worker group, if any: ``RunState`` or None."""
        import ray.train

        from raytrain_hymt.checkpoint import restore_rank

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            state = restore_rank(self.engine, folder, self.rank)
        if self.rank == 0:
            log.info("resumed from %s at step %d", checkpoint.path, state.step)
        return state

    def train_step(self, global_batch: dict) -> dict[str, float]:
        """One optimizer step over this rank's share of ``global_batch``; returns the step's metrics."""
        opt = self.cfg.optim
        t0 = time.perf_counter()
        micro = [self.collate(rank_slice(global_batch, a, self.rank, self.world, opt.micro_batch_size))
                 for a in range(opt.grad_accum)]
        local_targets = float(sum(int(m["num_target_tokens"]) for m in micro))
        local_tokens = float(sum(int(s.sum()) for m in micro for s in m["seq_lens"]))
        doc_sq = float(sum(int((s.astype(np.int64) ** 2).sum()) for m in micro for s in m["seq_lens"]))
        global_targets, global_tokens, global_doc_sq = _all_reduce_sum([local_targets, local_tokens, doc_sq], self.device)
        scale = self.world / max(global_targets, 1.0)
        loss_total = 0.0
        for m in micro:
            loss_sum = _forward_loss(self.engine, m, self.device)
            # DeepSpeed averages over ranks; scaling by world / global targets makes the result the mean
            # over every target token of the global step. scale_wrt_gas=False: no extra 1/accum.
            self.engine.backward(loss_sum * scale, scale_wrt_gas=False)
            self.engine.step()
            loss_total += float(loss_sum.detach())
        (loss_global,) = _all_reduce_sum([loss_total], self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        from raytrain_hymt.metrics import mfu

        n, layers, heads, head_dim = self.shape
        flops = 6.0 * n * global_tokens + 12.0 * layers * heads * head_dim * global_doc_sq
        grad_norm = self.engine.get_global_grad_norm()
        metrics = {
            "train/loss": loss_global / max(global_targets, 1.0),
            "train/lr": self.engine.get_lr()[0],
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/tokens_per_s_per_worker": global_tokens / seconds / self.world,
            "train/target_tokens": global_targets,
            "train/step_time_s": seconds,
            "train/memory_gib": _memory_gib(self.device),
        }
        util = mfu(flops, seconds, self.world, self.peak)
        if util is not None:
            metrics["train/mfu"] = util
        return metrics

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over the whole validation set (every rank evaluates its slice)."""
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
        return total_loss / max(total_tokens, 1.0)


def train_loop(loop_config: dict) -> None:
    """Ray Train entry point (``TorchTrainer(train_loop, train_loop_config=...)``)."""
    import ray.train

    from raytrain_hymt.checkpoint import RunState, save_rank_checkpoint, step_tag
    from raytrain_hymt.tracking import make_tracker

    from raytrain_hymt.quiet import quiet_ray

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_ray()
    inputs = LoopInputs(**loop_config)
    w = Worker(inputs)
    w.build()
    cfg = w.cfg
    state = w.restore()
    step = state.step if state else 0
    epoch = state.epoch if state else 0
    skip = state.batch_in_epoch if state else 0
    tracker = make_tracker(
        w.rank == 0 and cfg.tracking.enabled and inputs.tracking_run_id is not None,
        tracking_uri=inputs.tracking_uri, experiment=cfg.tracking.experiment, run_name=cfg.run.name or "",
        run_id=inputs.tracking_run_id, local_dir=inputs.run_dir, tensorboard=cfg.tracking.tensorboard,
    )
    train = ray.train.get_dataset_shard("train")
    global_rows = w.world * cfg.optim.grad_accum * cfg.optim.micro_batch_size
    if w.rank == 0:
        log.info("training %d steps (%d per epoch) on %d workers, global batch %d rows",
                 w.total_steps, w.per_epoch, w.world, global_rows)
    val_loss = None
    while step < w.total_steps:
        batches = train.iter_batches(batch_size=global_rows, batch_format="numpy", drop_last=True, prefetch_batches=2)
        for index, global_batch in enumerate(batches):
            if index < skip:
                continue
            metrics = w.train_step(global_batch)
            step += 1
            last = step >= w.total_steps
            if step % cfg.eval.every_steps == 0 or last:
                val_loss = w.validate()
                metrics["val/loss"] = val_loss
            if step % cfg.tracking.log_every_steps == 0 or "val/loss" in metrics:
                tracker.log_metrics(metrics, step=step)
            if w.rank == 0 and (step % cfg.tracking.log_every_steps == 0 or last):
                extra = f" val {val_loss:.4f}" if "val/loss" in metrics else ""
                log.info("step %d/%d loss %.4f%s lr %.2e grad %.3f %.0f tok/s/worker", step, w.total_steps,
                         metrics["train/loss"], extra, metrics["train/lr"], metrics["train/grad_norm"],
                         metrics["train/tokens_per_s_per_worker"])
            if step % cfg.checkpoint.every_steps == 0 or last:
                run_state = RunState(step=step, epoch=epoch, batch_in_epoch=index + 1, world_size=w.world,
                                     tag=step_tag(step), zero_stage=cfg.deepspeed.zero_stage,
                                     tracking_run_id=inputs.tracking_run_id)
                folder = save_rank_checkpoint(w.engine, run_state, w.rank, w.tokenizer)
                report = {"step": step, "train_loss": metrics["train/loss"]}
                if val_loss is not None:
                    report["val_loss"] = val_loss
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(folder),
                                 checkpoint_dir_name=f"checkpoint_{run_state.tag}",
                                 delete_local_checkpoint_after_upload=True)
            if step >= w.total_steps:
                break
        else:
            epoch, skip = epoch + 1, 0
            continue
        break
    tracker.close()
