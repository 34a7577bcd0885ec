"""The configuration's sections for where and how a run runs: scaling, checkpoints, tracking,
evaluation, the hyperparameter search and the run itself (:mod:`raytrain_hymt.config`'s tree).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain_hymt.languages import parse_direction

from raytrain_hymt.config_sections import _Section
from raytrain_hymt.storage import is_uri

_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ScalingConfig(_Section):
    """Workers and their resources."""

    num_workers: int = Field(2, ge=1)
    """Training workers (one per GPU); with ``min_workers``, the most workers an elastic run uses."""
    min_workers: int | None = Field(None, ge=1)
    """Elastic training: the fewest workers the run goes on with (Ray Train's
    ``ScalingConfig(num_workers=(min_workers, num_workers))``). The run starts on as many workers as the
    cluster holds, up to ``num_workers``; a lost node restarts it from the latest checkpoint on the
    workers left (charged to ``checkpoint.max_failures``), a node that comes back restarts it on more
    workers after ``elastic_resize_monitor_interval_s``. Needs ``optim.global_batch_rows`` divisible by
    every worker count from ``min_workers`` to ``num_workers`` (× ``optim.micro_batch_size``), so each
    restart keeps the trajectory, and whole ``cpus_per_worker``. None: always ``num_workers`` workers."""
    elastic_resize_monitor_interval_s: float = Field(60.0, ge=0)
    """Elastic training: while the workers run, how often, in seconds, Ray Train looks for room for more
    workers (a node that came back or joined); finding it restarts the run from its latest checkpoint on
    the larger count. Ignored without ``min_workers``."""
    use_gpu: bool = False
    """One GPU per worker; off: CPU workers with gloo (tests, demos)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Logical CPUs each worker reserves."""
    local_num_cpus: int | None = Field(None, ge=1)
    """Logical CPUs declared when this job starts its own local Ray (None: at least 4, since 2 workers
    plus the tokenizer actors never get scheduled on 2 logical CPUs)."""
    env: dict[str, str] = {}
    """Environment variables for the run's processes (NCCL settings such as ``NCCL_SOCKET_IFNAME``, an
    S3-compatible ``AWS_ENDPOINT_URL``): set on the driver, and passed to every training worker and
    evaluation replica through its Ray runtime environment. Values of secret-looking names are redacted
    from MLflow. Numbers are written as text (``NCCL_IB_DISABLE: 1`` is ``"1"``)."""

    @model_validator(mode="after")
    def _check(self) -> ScalingConfig:
        if self.min_workers is None:
            return self
        if self.min_workers > self.num_workers:
            raise ValueError(f"scaling.min_workers ({self.min_workers}) must be at most scaling.num_workers "
                             f"({self.num_workers}), the most workers of an elastic run")
        if self.cpus_per_worker != int(self.cpus_per_worker):
            # Ray's elastic policy counts the workers a node fits with whole-number division of its
            # resources: fractional CPUs make it decide on counts it then cannot place.
            raise ValueError(f"scaling.cpus_per_worker must be a whole number in an elastic run (scaling.min_workers "
                             f"set), got {self.cpus_per_worker:g}: Ray Train's elastic policy miscounts fractional CPUs")
        return self

    @property
    def worker_counts(self) -> range:
        """Every worker count a run may train on: ``num_workers`` alone, or ``min_workers`` to ``num_workers``."""
        return range(self.min_workers or self.num_workers, self.num_workers + 1)

    @field_validator("env", mode="before")
    @classmethod
    def _env_as_text(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value
        out = {}
        for key, item in value.items():
            if not isinstance(key, str) or not _ENV_NAME_RE.fullmatch(key):
                raise ValueError(f"{key!r} is not an environment variable name (letters, digits, _; not a digit first)")
            if isinstance(item, bool) or not isinstance(item, (str, int, float)):
                raise ValueError(f"{key}: give text or a number (got {item!r}); quote it, e.g. '1' or 'true'")
            out[key] = str(item)
        return out


class CheckpointConfig(_Section):
    """Checkpoints and failure handling."""

    every_steps: int = Field(50, ge=1)
    """Save a checkpoint every this many optimizer steps (and always at the end). A failure loses at most
    this many steps of work."""
    num_to_keep: int = 2
    """Checkpoints kept in storage (the newest), at least 2: when the newest was cut off mid-write, the
    run resumes from the one before."""
    max_failures: int = Field(1, ge=-1)
    """Worker-group restarts allowed before the job fails (-1: unlimited). Each restart resumes from the
    latest whole checkpoint."""
    async_upload: bool = False
    """Upload checkpoints to ``run.storage_root`` in a background thread (Ray's
    ``CheckpointUploadMode.ASYNC``): training goes on while a slow object store receives the files, and a
    worker lost during the upload loses that checkpoint. Off: every rank waits until its shard is stored
    and Ray Train has committed the checkpoint, so a worker lost right after it cannot take it along."""
    on_nonfinite: Literal["skip", "fail"] = "skip"
    """A step whose loss or gradient norm is NaN/inf: ``skip`` discards the step's update (the batch is
    consumed, counted in ``train/skipped_steps`` and logged); ``fail`` stops the run with an error naming
    the step and rank. Either way the optimizer update never happens."""


    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        if self.num_to_keep < 2:
            raise ValueError(
                f"checkpoint.num_to_keep must be at least 2 (got {self.num_to_keep}): when the newest checkpoint "
                "was cut off mid-write, the run resumes from the one before, which must still exist"
            )
        return self


class TrackingConfig(_Section):
    """MLflow tracking (rank 0 only)."""

    enabled: bool = True
    """Log to MLflow."""
    tracking_uri: str | None = None
    """MLflow server or store; None: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<storage_root>/mlflow.db``."""
    experiment: str = "raytrain_hymt"
    """MLflow experiment (created if missing)."""
    log_every_steps: int = Field(1, ge=1)
    """Log training metrics every this many optimizer steps."""
    tensorboard: bool = False
    """Also write the scalars as TensorBoard event files under ``<run folder>/tensorboard``."""
    log_model: bool = False
    """Upload the exported Hugging Face model folder as an MLflow artifact (off: a 7B model is ~15 GB;
    the run's ``model_dir`` tag says where it is)."""
    retry_interval_s: float = Field(30.0, gt=0)
    """While the tracking server is unreachable, try it again at most this often (each try costs at most
    ``$MLFLOW_HTTP_REQUEST_TIMEOUT``, 5 s by default); metrics wait in a queue and in ``metrics.jsonl``."""


class EvalConfig(_Section):
    """Validation during training, and BLEU/chrF on a held-out test set after it."""

    every_steps: int = Field(50, ge=1)
    """Compute the validation loss every this many optimizer steps (and at the end)."""
    test_set: str | None = None
    """Folder of a multi-way test set, one line-aligned file per language named by its code (FLORES-200's
    ``devtest/``: ``eng_Latn.devtest``, ``zho_Hans.devtest``...). When set, the exported model translates
    it at the end of the run and BLEU/chrF go to MLflow (``hymt evaluate`` scores any model). None: off."""
    directions: list[str] = Field(default_factory=lambda: ["en-zh", "zh-en"], min_length=1)
    """Directions scored on ``test_set``, ``<source>-<target>`` with any language code (``zh-Hant-en``)."""
    max_sentences: int | None = Field(None, ge=1)
    """Translate only the first this many lines per direction (None: all; FLORES devtest has 1,012)."""
    max_new_tokens: int = Field(256, ge=1)
    """Longest translation generated, in tokens (greedy decoding stops earlier at the end-of-answer token)."""
    batch_size: int = Field(64, ge=1)
    """Sentences per ``generate`` call on each translating replica (64 decoded a 7B model 2.3× faster
    than 16 on H200s, README "Evaluation")."""
    workers: int | None = Field(None, ge=1)
    """Model replicas translating in parallel (one GPU each with ``scaling.use_gpu``; never more than
    there are batches); None: ``scaling.num_workers``."""
    bleu_every_steps: int | None = Field(None, ge=1)
    """BLEU/chrF during training: every this many steps the model being trained translates the first
    ``bleu_sentences`` lines of each direction of ``test_set`` (needs ``test_set``), logged as
    ``val/<set>/<src>-<tgt>/bleu`` (and chrf, chrfpp, ter) with the translations as artifacts. None: off."""
    bleu_sentences: int = Field(32, ge=1)
    """Lines per direction of the sample ``bleu_every_steps`` translates (the same rows as ``hymt
    evaluate --set eval.max_sentences=<this>``)."""

    @field_validator("test_set")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        # Workers run elsewhere (BLEU during training reads it on rank 0): a path relative to the
        # driver's working directory would not be found there.
        return str(Path(value).expanduser().resolve()) if value else value

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.bleu_every_steps is not None and not self.test_set:
            raise ValueError("eval.bleu_every_steps translates a sample of eval.test_set: set eval.test_set too")

        seen: dict[tuple[str, str], str] = {}
        for direction in self.directions:
            pair = parse_direction(direction)
            if pair in seen:
                raise ValueError(f"eval.directions: {direction!r} is {seen[pair]!r} again ({pair[0]}-{pair[1]})")
            seen[pair] = direction
        return self


class TuneConfig(_Section):
    """Hyperparameter search (``hymt tune``): every trial is a full training run of this config.

    Each list below is a grid dimension (trials = the product of the lists × ``num_samples``);
    ``lr_range`` instead draws ``num_samples`` learning rates log-uniformly per grid point.
    """

    lr_grid: list[float] | None = None
    """Learning rates to try (a grid). Exactly one of ``lr_grid`` and ``lr_range`` is set."""
    lr_range: tuple[float, float] | None = None
    """``[low, high]``: learning rates drawn log-uniformly between them."""
    num_samples: int = Field(1, ge=1)
    """Repeats of the grid; with ``lr_range``, learning rates drawn per grid point."""
    warmup_steps: list[int] | None = None
    """Optional grid of ``optim.warmup_steps``."""
    lora_rank: list[int] | None = None
    """Optional grid of ``lora.rank`` (turns ``lora.enabled`` on in every trial)."""
    grace_period_steps: int | None = Field(None, ge=1)
    """ASHA: steps every trial runs before it can be stopped early (None: ``eval.every_steps``). The
    validation loss is reported every ``eval.every_steps``; ASHA compares trials on it."""
    reduction_factor: float = Field(2.0, gt=1)
    """ASHA: at each rung only the best ``1/reduction_factor`` of the trials continue."""
    max_concurrent_trials: int | None = Field(None, ge=1)
    """Upper bound on trials running at once (None: as many as the cluster's CPUs/GPUs fit, each trial
    needing ``scaling.num_workers`` workers plus ``driver_cpus``)."""
    driver_cpus: float = Field(0.5, gt=0)
    """Logical CPUs of each trial's driver (the Tune trial that runs the TorchTrainer; it mostly waits)."""
    seed: int | None = None
    """Seed of the sampling of ``lr_range`` (None: random)."""

    @model_validator(mode="after")
    def _check(self) -> TuneConfig:
        if (self.lr_grid is None) == (self.lr_range is None):
            raise ValueError("set exactly one of tune.lr_grid (a list) and tune.lr_range ([low, high])")
        if self.lr_grid is not None and (not self.lr_grid or min(self.lr_grid) <= 0):
            raise ValueError(f"tune.lr_grid must be a non-empty list of positive numbers (got {self.lr_grid})")
        if self.lr_range is not None and not 0 < self.lr_range[0] < self.lr_range[1]:
            raise ValueError(f"tune.lr_range must be [low, high] with 0 < low < high (got {list(self.lr_range)})")
        for name in ("warmup_steps", "lora_rank"):
            values = getattr(self, name)
            if values is not None and not values:
                raise ValueError(f"tune.{name} is an empty list: leave it out or give values")
        return self


class RunConfig(_Section):
    """Where results go and what the run is called."""

    storage_root: str = "~/hymt_runs"
    """Absolute folder or URI holding every run (checkpoints, exported models, ``mlflow.db``); a shared
    filesystem or bucket on multi-node clusters."""
    name: str | None = None
    """Run name; None: ``<preset>-<timestamp>``. Running again with the same name resumes the run."""
    export: bool = True
    """Export a Hugging Face model folder (``<run folder>/model``) at the end of training. The training
    workers write it straight to storage; the driver never loads the weights."""
    export_shard_mb: int = Field(5000, ge=1)
    """Largest safetensors shard of an export, in MB (a single larger tensor gets a shard of its own). The
    exporting process holds at most one shard in memory."""
    seed: int = 0
    """Seed of model initialisation (tiny model) and dropout."""
    allow_config_change: bool = False
    """Resume a run although its config (or its data) differs from the one it started with in something
    that changes the training trajectory (data, model, optimizer, schedule, batch). Off: such a resume
    stops and names the differing fields. The differences are recorded either way."""

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.name is not None:
            problem = run_name_problem(self.name)
            if problem:
                raise ValueError(f"run.name {problem}")
        return self

    @property
    def storage_path(self) -> str:
        """``storage_root`` with ``~`` expanded and made absolute (URIs unchanged)."""
        if is_uri(self.storage_root):
            return self.storage_root
        return str(Path(os.path.expanduser(self.storage_root)).resolve())


def run_name_problem(name: str) -> str | None:
    """What is wrong with a run name, or None: a run is the one folder ``<run.storage_root>/<name>``, so
    its name is one path segment (``../x`` or ``/abs`` would write outside ``run.storage_root``)."""
    if not name.strip() or name in (".", "..") or "/" in name or "\\" in name or name.startswith("~"):
        return (f"{name!r} is not a run name: a run is the folder <run.storage_root>/<name>, so the name is one "
                "folder name (no '/', not '.' or '..'); to store runs elsewhere set run.storage_root")
    return None
