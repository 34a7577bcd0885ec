"""DeepSpeed: the config builder (pure), the learning-rate schedule (pure), LoRA and engine initialisation,
and the ninja that compiles DeepSpeed's C++ ops.

DeepSpeed's C++ ops (``shm_comm``, ``cpu_adam``) are compiled on first use and cached. torch builds them
with the first ``ninja`` on ``PATH``. A machine may have its own (Debian's ninja-build 1.11) besides the
one this Python environment installs with DeepSpeed (pip's, 1.13). The two do not accept each other's
record of the cached build, so every switch between them compiled both ops again, about 70 CPU-seconds
each: ``use_this_environments_ninja`` makes every process of the project use the environment's own.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
from pathlib import Path
from typing import Any

from raytrain_hymt.config.schema import Config, LoraConfig
from raytrain_hymt.errors import ConfigError


def build_ds_config(cfg: Config, world_size: int, on_gpu: bool, load_universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config for ``cfg`` on ``world_size`` workers, merged with the user's JSON if given.

    ``load_universal``: the engine will load a universal checkpoint (a resume on another worker count,
    ``checkpoint.load_resharded``); DeepSpeed reads ``checkpoint.load_universal`` only when it loads."""
    ds, opt = cfg.deepspeed, cfg.optim
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "overlap_comm": ds.overlap_comm and ds.zero_stage > 0,
        "contiguous_gradients": True,
        "reduce_bucket_size": ds.reduce_bucket_size,
    }
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": opt.micro_batch_size,
        "gradient_accumulation_steps": opt.accumulation(world_size),
        "train_batch_size": opt.rows_per_step(world_size),
        "gradient_clipping": opt.max_grad_norm,
        "zero_optimization": zero,
        "bf16": {"enabled": ds.precision == "bf16"},
        "fp16": {"enabled": ds.precision == "fp16", "initial_scale_power": 16},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": opt.lr,
                "betas": list(opt.betas),
                "eps": opt.eps,
                "weight_decay": opt.weight_decay,
                # Plain torch AdamW: no JIT-built fused kernel on CPU; on GPU torch's fused path is as fast.
                "torch_adam": not ds.offload_optimizer,
                "adam_w_mode": True,
            },
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if ds.communication_data_type:
        config["communication_data_type"] = ds.communication_data_type  # the names DeepSpeed uses
    if ds.config_file:
        config = merge_user_ds_config(config, json.loads(Path(ds.config_file).read_text()), ds.config_file)
    if load_universal:  # after the user's JSON: its own checkpoint settings stay, this one is the resume's
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
    return config


def merge_user_ds_config(ours: dict, theirs: dict, source: str, path: str = "") -> dict:
    """Merge a user's DeepSpeed JSON into ours: "auto" takes our value, a different value is an error."""
    merged = dict(ours)
    for key, value in theirs.items():
        where = f"{path}{key}"
        if value == "auto":
            if key not in ours:
                raise ConfigError(f"{source}: '{where}' is \"auto\" but raytrain_hymt does not set it; give a value")
            continue
        if key not in ours:
            # A section we do not set may still hide an "auto" deeper down: check it all the same.
            merged[key] = merge_user_ds_config({}, value, source, f"{where}.") if isinstance(value, dict) else value
        elif isinstance(value, dict) and isinstance(ours[key], dict):
            merged[key] = merge_user_ds_config(ours[key], value, source, f"{where}.")
        elif value != ours[key]:
            raise ConfigError(
                f"{source}: '{where}' is {value!r} but the config sets {ours[key]!r}; change the config field "
                "(e.g. --set deepspeed.zero_stage=3) or write \"auto\" in the JSON"
            )
    return merged


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (0-based): warmup, then decay."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def apply_lora(model, lora: LoraConfig):
    """Wrap ``model`` in peft LoRA adapters on ``lora.target_modules``; every base weight is frozen."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(lora.target_modules) - leaf_names)
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"lora.target_modules: {missing} are not modules of this model; its linear layers are {linear}")
    peft_config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM", bias="none",
    )
    return get_peft_model(model, peft_config)


def initialize_engine(model, cfg: Config, world_size: int, total_steps: int, on_gpu: bool,
                      load_universal: bool = False):
    """``deepspeed.initialize`` with our config and schedule; returns ``(engine, ds_config)``.
    ``load_universal``: see :func:`build_ds_config`."""
    import deepspeed
    import torch

    from raytrain_hymt.train.engine import use_this_environments_ninja

    use_this_environments_ninja()  # DeepSpeed builds or loads its ops in initialize, nowhere earlier

    ds_config = build_ds_config(cfg, world_size, on_gpu, load_universal)
    opt = cfg.optim

    def scheduler(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total_steps, opt.warmup_steps, opt.schedule, opt.min_lr_ratio)
        )

    if cfg.deepspeed.activation_checkpointing:
        # Non-reentrant checkpointing: works with frozen inputs (LoRA) and with ZeRO-3's gathered params.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=params, config=ds_config, lr_scheduler=scheduler
    )
    return engine, ds_config


def use_this_environments_ninja() -> None:
    """Put this Python environment's scripts folder first on ``PATH`` when it holds a ``ninja``, so that
    every process of the project compiles DeepSpeed's ops with the same one (and its children inherit it)."""
    scripts = sysconfig.get_path("scripts")
    if not (Path(scripts) / "ninja").is_file():
        return
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != scripts]
    os.environ["PATH"] = os.pathsep.join([scripts, *rest])
