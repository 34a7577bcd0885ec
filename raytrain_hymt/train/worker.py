"""One training worker's state and what it does: build the engine, resume, train a step, validate, export.

:mod:`~raytrain_hymt.train.loop` drives it; the split of each global batch over ranks is
:mod:`~raytrain_hymt.data.epochs`', the fetch of a rank's rows :mod:`~raytrain_hymt.data.blocks`'. A restarted
run resumes exactly after the last checkpointed step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from raytrain_hymt.config.schema import Config
from raytrain_hymt.errors import NonFiniteError
from raytrain_hymt.data.epochs import micro_slice, rank_slice, steps_per_epoch
from raytrain_hymt.train.distributed import all_reduce_sum, step_loss
from raytrain_hymt.storage import METRICS_FILE

log = logging.getLogger("raytrain_hymt")

#: Names inside a run folder written by the workers: the exported model, rank 0's metric copies.
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
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
    """Name of the driver's progress actor (``console.progress``): rank 0 publishes every step there."""
    tracking_run_key: str | None = None
    """The job's MLflow key (``run.json``): rank 0 finds or creates the run by it while its id is unknown."""
    train_blocks: object = None
    """Where the training rows are (``data.blocks.train_blocks``): each rank fetches its own rows from there."""
    val_blocks: object = None
    """Where the validation rows are (``data.blocks.val_blocks``): every rank reads them all."""
    submission: str | None = None
    """This submission's id (``checkpoint.RunState.submission``), new for every ``run_training``."""


def _setup_environment(use_gpu: bool) -> torch.device:
    if not use_gpu:  # DeepSpeed's accelerator came with the worker's runtime environment (driver.train)
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


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

    def __init__(self, inputs: LoopInputs, rank: int, world: int):
        """``rank`` of ``world`` workers (Ray Train's context gives them; torch.distributed's would do)."""
        self.cfg = Config.model_validate(inputs.config)
        self.inputs = inputs
        self.device = _setup_environment(self.cfg.scaling.use_gpu)
        self.rank, self.world = rank, world
        self.resumed_from: str | None = None  # the checkpoint folder restore() loaded
        opt = self.cfg.optim
        # Derived from the worker count Ray gave this attempt: optim.global_batch_rows keeps the global
        # batch whatever that count is (a ConfigError when it does not divide).
        self.accum = opt.accumulation(world)
        self.per_epoch = steps_per_epoch(inputs.train_rows, self.world, self.accum, opt.micro_batch_size)
        if self.per_epoch == 0:
            raise ValueError(
                f"{inputs.train_rows} training rows are fewer than one global batch "
                f"({self.world} workers × {self.accum} accumulation × {opt.micro_batch_size} rows)"
            )
        self.total_steps = opt.max_steps or opt.epochs * self.per_epoch
        self.global_rows = self.world * self.accum * opt.micro_batch_size

    def build(self, load_universal: bool | None = None) -> None:
        """Load the model and initialise its DeepSpeed engine. ``load_universal`` (default: whether the
        checkpoint this run resumes from was saved on another worker count, ``resumes_universal``): the
        engine loads DeepSpeed's universal checkpoints, a switch DeepSpeed takes at initialize only."""
        from raytrain_hymt.train.checkpoint import base_identity
        from raytrain_hymt.train.engine import initialize_engine
        from raytrain_hymt.train.flops import matmul_params, peak_flops
        from raytrain_hymt.train.model import align_frozen_head, load_model, use_fused_loss
        from raytrain_hymt.tokenizer import load_tokenizer

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
        if load_universal is None:
            load_universal = self.resumes_universal()
        self.engine, self.ds_config = initialize_engine(
            model, cfg, self.world, self.total_steps, on_gpu=self.device.type == "cuda", load_universal=load_universal
        )
        if cfg.model.init_from and not self.resumes():  # a resume's own checkpoint holds newer weights
            self.start_from(cfg.model.init_from)
        if not cfg.model.fused_loss:  # after initialize, which may have moved the weights
            align_frozen_head(self.engine.module)
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

    def resumes(self) -> bool:
        """Whether Ray Train hands this run a checkpoint of its own to resume from."""
        import ray.train

        return ray.train.get_checkpoint() is not None

    def start_from(self, checkpoint: str) -> None:
        """``model.init_from``: load the weights of another run's ``checkpoint`` (a path or URI the driver
        checked), LoRA adapters onto this run's base; the optimizer, schedule and step count stay new."""
        import ray.train

        from raytrain_hymt.train.checkpoint import load_weights_only

        with ray.train.Checkpoint(checkpoint).as_directory() as folder:
            state = load_weights_only(self.engine, folder, where=checkpoint)
        if self.rank == 0:
            log.info("starting from the weights of %s (step %d of its run)", checkpoint, state.step)

    def resumes_universal(self) -> bool:
        """Whether the checkpoint ``restore`` will try first (the newest whole one) loads only through
        DeepSpeed's universal form on this worker count."""
        import ray.train

        from raytrain_hymt.train.checkpoint import (
            IncompleteCheckpointError,
            check_checkpoint,
            needs_universal,
            older_checkpoints,
        )

        latest = ray.train.get_checkpoint()
        if latest is None:
            return False
        for path in [latest.path, *older_checkpoints(latest.filesystem, latest.path)]:
            try:
                return needs_universal(check_checkpoint(latest.filesystem, path), self.world)
            except IncompleteCheckpointError:
                continue
        return False

    def restore(self):
        """Resume from the newest whole checkpoint of this run, if any: ``RunState`` or None.

        Ray hands over only its latest checkpoint; when that one was cut off mid-write (a marker missing,
        a file short: ``check_checkpoint``) or DeepSpeed cannot load it, the older ones in the run folder
        are tried, newest first, with a warning that says why. Every rank decides alike (the checks read
        the same storage; a load error on any rank is shared by an all-reduce).
        """
        import ray.train

        from raytrain_hymt.train.checkpoint import (
            IncompleteCheckpointError,
            check_base_model,
            check_checkpoint,
            check_same_shape,
            needs_universal,
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
            check_same_shape(saved, self.global_rows, self.cfg.deepspeed.zero_stage)
            if self.base_model is not None:
                check_base_model(saved.base_model, f"resuming from {path}", self.cfg.model.name_or_path,
                                 self.cfg.run.seed)
            if needs_universal(saved, self.world) != self.engine.load_universal_checkpoint():
                # A fallback across a change of worker count: only a new engine takes the other switch.
                self.engine.destroy()
                self.engine = None
                self.build(load_universal=needs_universal(saved, self.world))
            error = None
            try:
                with ray.train.Checkpoint(path, filesystem=fs).as_directory() as folder:
                    state = restore_rank(self.engine, folder, self.rank, self.world,
                                         ray.train.get_context().get_local_rank(), self.device, where=path)
            except Exception as e:  # noqa: BLE001 - a shard whole in size but not in content
                from raytrain_hymt.train.checkpoint import unreadable_file

                error = f"{path}: DeepSpeed could not load it on rank {self.rank}: {unreadable_file(fs, path, e)}"
                log.warning("not resuming from %s", error)
            (failed_ranks,) = all_reduce_sum([1.0 if error else 0.0], self.device)
            if not failed_ranks:
                self.resumed_from = path.rstrip("/").rsplit("/", 1)[-1]  # the loop says it (rank 0, once)
                if path != latest.path:
                    state.generation = next_generation(fs, path.rstrip("/").rsplit("/", 1)[0])
                self.engine.train()  # as after build: a restored run trains exactly like an uninterrupted one
                return state
            rejected.append(error or f"{path}: {int(failed_ranks)} rank(s) could not load it")
        raise IncompleteCheckpointError(
            "no usable checkpoint to resume from:\n  " + "\n  ".join(rejected)
            + "\nremove the run folder's checkpoint_step* folders (or use a new run name) to start over"
        )

    def train_step(self, rows: dict) -> dict[str, float]:
        """One optimizer step over this rank's rows of a global batch (accumulation × micro-batch rows in
        micro-step order: what the rank fetched, or ``ranks.rank_rows`` of a whole batch); the metrics."""
        from raytrain_hymt.train.flops import mfu, step_flops

        opt = self.cfg.optim
        t0 = time.perf_counter()
        micro = [self.collate(micro_slice(rows, a, opt.micro_batch_size)) for a in range(self.accum)]
        local_targets = float(sum(int(m["num_target_tokens"]) for m in micro))
        local_tokens = float(sum(int(s.sum()) for m in micro for s in m["seq_lens"]))
        # FLOPs are linear in the documents, so the global count is the sum of every rank's own.
        local_flops = step_flops(*self.shape, (int(n) for m in micro for s in m["seq_lens"] for n in s),
                                 trainable_params=self.trainable_matmul_params)
        global_targets, global_tokens, flops = all_reduce_sum([local_targets, local_tokens, local_flops], self.device)
        scale = self.world / max(global_targets, 1.0)
        lr = self.engine.get_lr()[0]  # the rate this step applies (the scheduler moves on inside step())
        losses = []
        for a, m in enumerate(micro):
            loss_sum = _forward_loss(self.engine, m, self.cfg.model.fused_loss)
            # DeepSpeed averages over ranks; scaling by world / global targets makes the result the mean
            # over every target token of the global step. scale_wrt_gas=False: no extra 1/accum.
            self.engine.backward(loss_sum * scale, scale_wrt_gas=False)
            losses.append(loss_sum.detach())
            if a == len(micro) - 1:
                # The step's one host sync, before the last engine.step() applies the update: a fail stops
                # with the weights untouched; a skip lets the NaN reach the gradients, whose non-finite norm
                # makes the optimizer discard the update (checked below).
                loss_global, bad_ranks = step_loss(losses, self.rank, self.world, self.device)
                if bad_ranks and self.cfg.checkpoint.on_nonfinite == "fail":
                    raise NonFiniteError(f"non-finite training loss at step {self.engine.global_steps + 1} on "
                                         f"rank(s) {bad_ranks} (checkpoint.on_nonfinite=fail; 'skip' drops such steps)")
            self.engine.step()
        skipped = not self.engine.was_step_applied()
        if bad_ranks and not skipped:
            raise NonFiniteError("DeepSpeed applied an update from a non-finite loss; the weights are no longer valid")
        if skipped and self.cfg.checkpoint.on_nonfinite == "fail" and self.cfg.deepspeed.precision != "fp16":
            raise NonFiniteError(f"non-finite gradient norm at step {self.engine.global_steps}: the update was "
                                 "discarded (checkpoint.on_nonfinite=fail; 'skip' drops such steps)")
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
        """Mean token loss over the whole validation set (every rank evaluates its slice of each batch of
        ``world × micro-batch`` rows); None when there are no validation rows (``data.val_fraction: 0``),
        so no one mistakes 0 for a perfect model."""
        from raytrain_hymt.data.blocks import RowFetcher
        from raytrain_hymt.data.packing import token_loss_sum

        self.engine.eval()
        b = self.cfg.optim.micro_batch_size
        loss, tokens = 0.0, 0.0
        for batch in RowFetcher(self.inputs.val_blocks).batches(self.world * b):
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
        total_loss, total_tokens = all_reduce_sum([loss, tokens], self.device)
        return total_loss / total_tokens if total_tokens else None

    def export(self) -> str | None:
        """Write the trained model to ``<run folder>/model`` from the workers (every rank takes part; rank
        0 writes and returns where it is), and for LoRA the adapters alone to ``<run folder>/adapter``.
        The driver never loads the weights."""
        from raytrain_hymt.train.export import export_from_engine
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
