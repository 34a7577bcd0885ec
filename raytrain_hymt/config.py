"""The typed configuration tree: the single source of every default.

Each field is documented once (its docstring), validated once (pydantic, plus the cross-field checks in
``Config``), defaulted once (here). Presets (``raytrain_hymt/presets/*.yaml``) only override;
``--set a.b=v`` overrides a preset. ``load_config`` turns any mistake into one ``ConfigError`` that names
the field, before Ray or a GPU is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from raytrain_hymt.config_run import (CheckpointConfig, EvalConfig, RunConfig, ScalingConfig, TrackingConfig, TuneConfig)
from raytrain_hymt.config_sections import (DataConfig, DeepSpeedConfig, LoraConfig, ModelConfig, OptimConfig, _Section)
from raytrain_hymt.errors import ConfigError

#: The shipped presets, read as package data so that an installed wheel finds them as well as a checkout does.
PRESETS: Traversable = resources.files("raytrain_hymt") / "presets"
DEFAULT_PRESET = "tiny-cpu"


class Config(_Section):
    """Everything a training job needs."""

    preset: str = DEFAULT_PRESET
    """Name of the preset this config came from (informational; part of the default run name)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    tune: TuneConfig | None = None
    """The hyperparameter search (``hymt tune``); ignored by ``hymt train``."""

    @model_validator(mode="after")
    def _check(self) -> Config:
        ds = self.deepspeed
        if ds.offload_param and ds.zero_stage != 3:
            raise ValueError(f"deepspeed.offload_param needs deepspeed.zero_stage 3 (got {ds.zero_stage})")
        if ds.offload_optimizer and ds.zero_stage == 0:
            raise ValueError("deepspeed.offload_optimizer needs deepspeed.zero_stage >= 1 (got 0)")
        if ds.precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("deepspeed.precision fp16 needs GPUs (scaling.use_gpu: true); use bf16 or fp32 on CPU")
        if self.model.attn_implementation == "flex_attention" and not self.scaling.use_gpu:
            # torch's CPU flex_attention has a forward but no backward: training would fail at step 1.
            raise ValueError(
                "model.attn_implementation flex_attention cannot train on CPU (no CPU backward in torch); "
                "use sdpa or eager, or set scaling.use_gpu: true"
            )
        for lever in ("fused_loss", "compile"):
            if getattr(self.model, lever) and not self.scaling.use_gpu:
                raise ValueError(f"model.{lever} needs GPUs (scaling.use_gpu: true); its kernels are GPU-only")
        if self.data.packing and self.data.pack_tokens < self.data.max_example_tokens:
            raise ValueError(
                f"data.pack_tokens ({self.data.pack_tokens}) must be >= data.max_example_tokens "
                f"({self.data.max_example_tokens}) so every example fits in a packed row"
            )
        # The worker count the run starts on must divide the global batch (Worker.__init__ checks again
        # the count each attempt gets). ConfigError is a ValueError: pydantic reports it as one.
        self.optim.accumulation(self.scaling.num_workers)
        if self.scaling.min_workers is not None:
            self._check_elastic()
        return self

    def _check_elastic(self) -> None:
        """An elastic run may restart on any count from min to max workers: each must keep the global batch."""
        s, opt = self.scaling, self.optim
        if opt.global_batch_rows is None:
            raise ValueError(
                "scaling.min_workers (elastic training) needs optim.global_batch_rows: without it the global batch "
                "is workers × optim.grad_accum × optim.micro_batch_size and changes whenever the worker count does")
        bad = [n for n in s.worker_counts if opt.global_batch_rows % (n * opt.micro_batch_size)]
        if bad:
            allowed = [n for n in range(1, s.num_workers + 1) if opt.global_batch_rows % (n * opt.micro_batch_size) == 0]
            raise ValueError(
                f"optim.global_batch_rows ({opt.global_batch_rows}) does not split into whole micro-batches "
                f"(optim.micro_batch_size {opt.micro_batch_size}) on {_counts(bad)} worker(s), and an elastic run may "
                f"restart on any count from scaling.min_workers to scaling.num_workers ({s.min_workers}..{s.num_workers}). "
                f"Counts up to {s.num_workers} that divide it: {_counts(allowed) or 'none'}; choose min_workers and "
                f"num_workers so that every count between them does, or a global batch that is a multiple of "
                f"{math.lcm(*s.worker_counts) * opt.micro_batch_size}")


def _counts(counts: list[int]) -> str:
    return ", ".join(str(n) for n in counts)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{key}' is not a section")
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"optim.lr=3e-5"`` → ``("optim.lr", 3e-05)``; the value is parsed as YAML (numbers, lists, null)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def preset_names() -> list[str]:
    """The names of the shipped presets (``tiny-cpu``, ``hy-mt-7b-lora``, ...), sorted."""
    return sorted(p.name.removesuffix(".yaml") for p in PRESETS.iterdir() if p.name.endswith(".yaml"))


def preset_path(name_or_file: str) -> Path | Traversable:
    """A YAML file path, or a shipped preset's name (``tiny-cpu``), as a file that exists."""
    candidate = Path(name_or_file)
    if candidate.suffix in (".yaml", ".yml") and candidate.exists():
        return candidate
    named = PRESETS / f"{name_or_file}.yaml"
    if named.is_file():
        return named
    raise ConfigError(f"config {name_or_file!r}: no such file, and no preset of that name "
                      f"(presets: {', '.join(preset_names())})")


def _format_validation_error(err: ValidationError, source: str, overrides: list[str]) -> str:
    """One line per bad field, each saying where its value came from: ``--set field=value`` or the file."""
    lines = ["invalid configuration:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f"got {value!r}, "
        # A section-level rule (loc "data") may involve the file's values and a --set alike.
        setters = [o for o in overrides if field and (o.split("=", 1)[0].strip() + ".").startswith(field + ".")]
        origin = ", ".join(f"--set {o}" for o in setters) or source
        lines.append(f"  {field or '(top level)'}: {e['msg']} ({shown}from {origin})")
    return "\n".join(lines)


def load_config(config: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a preset or YAML file (default ``tiny-cpu``), apply ``section.field=value`` overrides, validate."""
    path = preset_path(config or DEFAULT_PRESET)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    tree.setdefault("preset", Path(path.name).stem)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, str(path), list(overrides))) from None


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what a run actually used; loadable with ``--config``)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (lists and empty mappings kept whole)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
