"""The typed configuration tree: the single source of every default.

Each field is documented once (its docstring), validated once (pydantic, plus the cross-field checks in
``Config``), defaulted once (here). Presets (``raytrain_hymt/config/presets/*.yaml``) only override;
``--set a.b=v`` overrides a preset. ``load_config`` turns any mistake into one ``ConfigError`` that names
the field, before Ray or a GPU is touched.

The sections, in the order a config file lists them: what is trained and how (data, model, optimizer,
DeepSpeed, LoRA), then where and how a run runs (scaling, checkpoints, tracking, evaluation, the
hyperparameter search, the run itself); ``Config`` ties them together and loads presets and overrides.
"""

from __future__ import annotations

import codecs
import math
import os
import re
import typing
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raytrain_hymt.errors import ConfigError
from raytrain_hymt.languages import parse_direction
from raytrain_hymt.storage import is_uri


class _Section(BaseModel):
    # Field docstrings become the schema's descriptions, so each field is documented exactly once.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class SourceConfig(_Section):
    """One parallel corpus. Several sources are mixed by ``weight``."""

    path: str
    """File, glob or URI (``s3://``, ``gs://``, any pyarrow filesystem). ``sample:`` means the bundled
    Tatoeba eng-zho sample. Moses format: the common prefix; files are ``<path>.<src_lang>`` and
    ``<path>.<tgt_lang>``."""
    format: Literal["tatoeba", "tsv", "csv", "moses", "jsonl", "parquet", "hf_disk", "hf_hub"] = "tatoeba"
    """``tatoeba``: 4-column TSV ``src_lang, tgt_lang, src, tgt``; ``tsv``/``csv``: 2 columns src, tgt;
    ``moses``: two line-aligned files; ``jsonl``/``parquet``: columns named below (or a HF
    ``translation`` dict); ``hf_disk``: a ``save_to_disk`` folder; ``hf_hub``: a ``load_dataset`` name."""
    src_lang: str | None = None
    """Source language code (any alias Hunyuan-MT knows). Required unless the rows carry languages."""
    tgt_lang: str | None = None
    """Target language code. Required unless the rows carry languages."""
    src_column: str = "src"
    """Column of the source text (jsonl/parquet/hf). A dict/struct column keyed by language, like Hugging
    Face's ``translation: {"en": ..., "zh": ...}``, is read at ``src_lang``: set both columns to it."""
    tgt_column: str = "tgt"
    """Column of the target text (jsonl/parquet/hf); a dict/struct column is read at ``tgt_lang``."""
    split: str = "train"
    """Split name for ``hf_hub`` / ``hf_disk`` sources that hold several splits."""
    weight: float = Field(1.0, gt=0)
    """How often each kept pair is used: 1.0 once, 3.0 three times, 0.5 a seeded half (the rest counted
    as ``subsampled``). Applied after cleaning and dedup."""
    encoding: str = "utf-8"
    """Text encoding of the files (tatoeba/tsv/csv/moses/jsonl): any codec Python knows, e.g. ``gb18030``,
    ``shift_jis``, ``euc-kr``, ``big5``, ``utf-16``, ``cp1252``. A byte order mark (UTF-8's, UTF-16's) is
    skipped. Checked on the first lines of each file before Ray starts, which names the likely encoding
    when they do not decode. Not for parquet/hf_disk/hf_hub, whose text is UTF-8 by definition."""

    @field_validator("encoding")
    @classmethod
    def _known_encoding(cls, value: str) -> str:
        if (problem := text_encoding_problem(value)) is not None:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _text_files_only(self) -> SourceConfig:
        if self.format in ("parquet", "hf_disk", "hf_hub") and codecs.lookup(self.encoding).name != "utf-8":
            raise ValueError(f"encoding {self.encoding!r} is for text files; format {self.format!r} stores its text "
                             "as UTF-8, which it is read as: remove encoding")
        return self


def text_encoding_problem(value: str) -> str | None:
    """Why ``value`` is no text encoding Python knows (``sjis2``; ``base64`` is a codec, not one), else None."""
    try:
        "a".encode(value)  # a codec that is no text encoding (base64, zlib, rot13) raises LookupError here too
    except LookupError:
        return (f"{value!r} is not a text encoding Python knows (e.g. utf-8, utf-16, gb18030, shift_jis, euc-kr, big5, "
                "cp1252)")
    return None


class DataConfig(_Section):
    """Reading, cleaning, prompting, tokenizing, splitting and packing the corpus."""

    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(path="sample:")])
    """The corpora to train on (default: the bundled Tatoeba eng-zho sample)."""
    prepared_path: str | None = None
    """A dataset written by ``hymt prepare``: when set, ``sources`` are not read again."""
    both_directions: bool = False
    """Also train each pair in the reverse direction (target → source)."""
    val_fraction: float = Field(0.02, ge=0, lt=0.5)
    """Share of source sentences held out for validation (split by a hash of the source sentence, so
    alternative translations of one sentence never straddle train and validation)."""
    max_val_examples: int = Field(512, ge=0)
    """Cap on validation examples, so evaluation stays cheap on large corpora."""
    max_example_tokens: int = Field(256, ge=16)
    """Longest prompt + answer, in tokens; longer pairs are dropped (counted as ``too_many_tokens``)."""
    min_chars: int = Field(1, ge=0)
    """Drop a pair whose shorter side has fewer characters (after normalisation)."""
    max_chars: int = Field(1000, ge=1)
    """Drop a pair whose longer side has more characters (after normalisation)."""
    max_length_ratio: float = Field(4.0, ge=1)
    """Drop pairs whose sides' lengths differ by more than this factor (CJK characters count double)."""
    drop_identical: bool = True
    """Drop pairs whose source equals the target (untranslated copies)."""
    dedup: bool = True
    """Drop exact duplicate pairs (same languages, source and target after normalisation), across all
    sources, keeping the one with the smallest ``example_id``; counted as ``duplicate``."""
    on_unsupported_language: Literal["drop", "error"] = "drop"
    """A row in a language Hunyuan-MT does not know (e.g. Tatoeba's ``wuu``): drop and count, or fail."""
    language_id: bool = True
    """Identify the language of each side (py3langid) and drop a pair whose source or target is, with
    confidence, another language than its label (counted as ``wrong_language``). Checks the pairs whose
    two languages the identifier knows and tells apart: not Tibetan, not Chinese against Traditional
    Chinese or Cantonese, not Malay against Indonesian; sides under 15 bytes stay unchecked (docs/data.md)."""
    max_bad_fraction: float = Field(0.01, ge=0, le=1)
    """Fail when more than this share of lines is malformed or not valid UTF-8 (below it: counted)."""
    packing: bool = True
    """Pack several examples per row with document-masked attention (fast); off: one padded example
    per row, padded to the longest (slow)."""
    pack_tokens: int = Field(1024, ge=16)
    """Tokens per packed row (the micro-batch row length)."""
    tokenize_actors: int = Field(1, ge=1)
    """Tokenizer actors in the Ray Data pool (one tokenizer each)."""
    tokenize_batch_size: int = Field(256, ge=1)
    """Rows per tokenization batch."""
    seed: int = 0
    """Seed of the train/validation split and of the data order (and, with the epoch, of each epoch's
    own order)."""
    sort_partitions: int | Literal["auto"] = "auto"
    """Partitions of the one sort that deduplicates and orders the examples; each is one block, held
    whole by the task that dedups and packs it. ``auto``: sized from the sources' bytes for blocks of
    about 128 MiB of tokenized examples (at least 2), so no task's memory grows with the corpus."""
    epoch_shuffle_rows: int = Field(8192, ge=1)
    """Rows of the training stream mixed at once for the per-epoch order: every epoch takes the rows in
    windows of this many (rounded down to whole global batches), cuts each into one lane per position of
    the global batch and draws every batch's rows from the lanes with seeds of ``(data.seed, epoch,
    window, lane)`` (docs/data.md). Each worker fetches and holds only its lanes: window / workers rows,
    ≈ that × ``pack_tokens`` × 12 bytes (8,192 rows of 1,024 tokens on 2 workers: ~50 MB). The training
    rows are stored in blocks of window / global batch rows, the unit a worker fetches."""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.sort_partitions != "auto" and self.sort_partitions < 2:
            raise ValueError(f"data.sort_partitions must be 'auto' or at least 2 (got {self.sort_partitions})")
        if not self.sources and not self.prepared_path:
            raise ValueError("data.sources is empty and data.prepared_path is not set: nothing to train on")
        if self.min_chars > self.max_chars:
            raise ValueError(f"data.min_chars ({self.min_chars}) exceeds data.max_chars ({self.max_chars})")
        return self


class ModelConfig(_Section):
    """Which model and tokenizer to fine-tune."""

    name_or_path: str = "tiny"
    """A local folder or hub id (``tencent/Hunyuan-MT-7B``); ``tiny``: the offline random-init
    ``hunyuan_v1_dense`` and bundled tokenizer used for demos and tests."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id when it differs from ``name_or_path``."""
    trust_remote_code: bool = False
    """Allow code from the model repository (Hunyuan-MT is native in transformers: leave off)."""
    family: Literal["auto", "hunyuan-mt", "hy-mt1.5", "hy-mt2"] = "auto"
    """Which model family's prompt templates (pinned copies of its model card) the examples are written
    in: ``hunyuan-mt`` (Hunyuan-MT-7B), ``hy-mt1.5`` (HY-MT1.5-1.8B/-7B: also terminology, context and
    formatted prompts), ``hy-mt2`` (Hy-MT2-1.8B/-7B: also terminology, style and background prompts).
    ``auto``: the family named in ``name_or_path`` (or, for a local folder, Hy-MT2's chat template), else
    ``hunyuan-mt`` with one info line."""
    attn_implementation: Literal["sdpa", "eager", "flex_attention"] = "sdpa"
    """Attention kernel. Packed rows need document masking: ``flex_attention`` (fast on GPU) or a dense
    block-diagonal mask through ``sdpa``/``eager``."""
    fused_loss: bool = False
    """Compute the output head and cross-entropy in one chunked kernel (Liger's fused linear
    cross-entropy) instead of materialising ``[tokens, vocab]`` logits: less memory at a 128k vocabulary,
    so longer micro-batches fit. GPU only (Triton kernels; needs the ``liger-kernel`` package)."""
    compile: bool = False
    """``torch.compile`` each decoder layer (regional compilation: one compile serves every layer).
    GPU only; the first steps are slower while it compiles."""
    init_from: str | None = None
    """Start a new run from the weights of another run's checkpoint: ``RUN`` (a run name under
    ``run.storage_root``, or the path or URI of a run folder) takes its newest whole checkpoint,
    ``RUN/checkpoint_step00000020`` that one. The new run starts at step 0 with a fresh optimizer, schedule and
    data order; a LoRA run loads the source's adapters onto the same base. The source must have trained the
    same ``model.name_or_path`` (and, with LoRA, the same base and adapter shape). Resolved to the
    checkpoint's full location before the run's ``config.yaml`` is written. An exported model folder (a run's
    ``model/``) is not a checkpoint: give it as ``model.name_or_path`` instead."""


class OptimConfig(_Section):
    """Optimizer, schedule and batch shape."""

    lr: float = Field(1e-5, gt=0)
    """Peak learning rate (Hunyuan-MT's own recipe: 1e-5 for full fine-tuning)."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Final learning rate as a fraction of ``lr`` at the end of the decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps (optimizer steps)."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(1.0, ge=0)
    """Gradient clipping by global norm (0: off)."""
    micro_batch_size: int = Field(1, ge=1)
    """Rows per worker per micro-step (a row is a pack of ``data.pack_tokens`` or one padded pair)."""
    grad_accum: int = Field(1, ge=1)
    """Micro-steps accumulated per optimizer step. Leave it at 1 when ``global_batch_rows`` is set: the
    accumulation is then derived from it."""
    global_batch_rows: int | None = Field(None, ge=1)
    """Rows (packed rows, or padded pairs without packing) per optimizer step, whatever the worker count:
    the accumulation is ``global_batch_rows / (scaling.num_workers × micro_batch_size)``, so a run keeps
    its trajectory on another worker count (resume after losing a node, elastic training). It must be a
    multiple of workers × micro-batch. None: the global batch is workers × ``grad_accum`` ×
    ``micro_batch_size``."""
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; None: ``epochs`` full passes."""
    epochs: int = Field(1, ge=1)
    """Passes over the training data when ``max_steps`` is not set."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.global_batch_rows is not None and self.grad_accum != 1:
            raise ValueError(
                f"optim.grad_accum ({self.grad_accum}) and optim.global_batch_rows ({self.global_batch_rows}) are "
                "both set: with global_batch_rows the accumulation is derived from it; leave optim.grad_accum at 1")
        return self

    def accumulation(self, workers: int) -> int:
        """Micro-steps per optimizer step on ``workers`` workers; raises ``ConfigError`` naming the fields
        when ``global_batch_rows`` does not divide into whole micro-batches of every worker."""
        if self.global_batch_rows is None:
            return self.grad_accum
        per_step = workers * self.micro_batch_size
        if self.global_batch_rows % per_step:
            raise ConfigError(
                f"optim.global_batch_rows ({self.global_batch_rows}) is not a multiple of scaling.num_workers "
                f"({workers}) × optim.micro_batch_size ({self.micro_batch_size}) = {per_step}: choose a global "
                "batch that every worker count you train on divides, or another micro-batch")
        return self.global_batch_rows // per_step

    def rows_per_step(self, workers: int) -> int:
        """Rows of one global batch on ``workers`` workers (``global_batch_rows`` when set)."""
        return workers * self.accumulation(workers) * self.micro_batch_size


class DeepSpeedConfig(_Section):
    """The DeepSpeed engine."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """ZeRO stage: 0 plain data parallel; 1 optimizer states, 2 + gradients, 3 + parameters sharded."""
    offload_optimizer: bool = False
    """Keep optimizer states (and the update) on the CPU (ZeRO-Offload; needs stage >= 1)."""
    offload_param: bool = False
    """Keep parameters on the CPU between uses (stage 3 only)."""
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    """Training precision; fp16 only on GPUs (DeepSpeed's CPU accelerator does not support it)."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """Data type of gradient all-reduce (DeepSpeed's form of DDP's fp16 compression hook);
    None: the training precision."""
    activation_checkpointing: bool = False
    """Recompute activations in backward (less memory, ~30% more compute)."""
    reduce_bucket_size: int = Field(200_000_000, ge=1)
    """Elements per gradient reduction bucket."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward."""
    config_file: str | None = None
    """A DeepSpeed JSON of your own (a ``ds_config.json`` as DeepSpeed documents it; "auto" values are filled
    from this config). A value that contradicts this config is an error."""


class LoraConfig(_Section):
    """LoRA adapters through ``peft``: only the adapters train; export merges them into the base weights."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight (the base model stays frozen)."""
    rank: int = Field(16, ge=1)
    """Adapter rank ``r``."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the adapter's update is multiplied by ``alpha / rank``."""
    dropout: float = Field(0.05, ge=0, lt=1)
    """Dropout on the adapter's input."""
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters; the default is Hunyuan-MT's own recipe (the attention projections
    of ``hunyuan_v1_dense``). Add ``gate_proj``, ``up_proj``, ``down_proj`` to adapt the MLP too."""

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the modules that get adapters (e.g. q_proj)")
        return self


def deepspeed_accelerator_env(use_gpu: bool) -> dict[str, str]:
    """The environment that names DeepSpeed's accelerator for a process that runs on ``use_gpu``'s device.

    DeepSpeed picks its accelerator once, when it is imported; without ``DS_ACCELERATOR`` it probes for
    CUDA and warns when it falls back to the CPU. Every CPU process the project starts takes the setting
    from here (training workers' and the export task's runtime environments, the driver itself); a GPU
    process leaves DeepSpeed to detect CUDA."""
    return {} if use_gpu else {"DS_ACCELERATOR": "cpu"}


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
    directions: list[str] | None = Field(None, min_length=1)
    """Directions scored on ``test_set``, ``<source>-<target>`` with any language code (``zh-Hant-en``).
    None: the directions the run's own corpus trains (the language pairs of ``data.sources``, or of the
    sources a prepared dataset was prepared from; reversed too with ``data.both_directions``), resolved
    when the run starts and kept in its ``config.yaml``."""
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
        for direction in self.directions or ():
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


#: The shipped presets, read as package data so that an installed wheel finds them as well as a checkout does.
PRESETS: Traversable = resources.files("raytrain_hymt.config") / "presets"
DEFAULT_PRESET = "tiny-cpu"


#: Fields whose default changes what a run trains, with the value that trains as the project did before the
#: field existed: a run whose saved config (or data fingerprint) predates the field is compared, and resumed,
#: with this value, not with today's default.
PREDATING_VALUES: dict[str, Any] = {"data.language_id": False}


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


#: What other fine-tuning tools (Hugging Face Trainer, DeepSpeed, PEFT, LLaMA-Factory, axolotl) call a setting
#: of this schema, wherever in the config it is written: ``learning_rate`` means ``optim.lr``.
FIELD_ALIASES: dict[str, str] = {
    **dict.fromkeys(("learning_rate", "base_lr", "peak_lr", "max_lr"), "optim.lr"),
    **dict.fromkeys(("lr_scheduler", "lr_scheduler_type", "scheduler", "lr_schedule", "decay"), "optim.schedule"),
    **dict.fromkeys(("min_lr", "final_lr"), "optim.min_lr_ratio"),
    **dict.fromkeys(("warmup_ratio", "warmup", "num_warmup_steps", "warmup_iters"), "optim.warmup_steps"),
    **dict.fromkeys(("batch_size", "per_device_train_batch_size", "micro_batch", "micro_batch_size_per_gpu",
                     "train_micro_batch_size_per_gpu"), "optim.micro_batch_size"),
    **dict.fromkeys(("train_batch_size", "global_batch_size", "total_batch_size"), "optim.global_batch_rows"),
    **dict.fromkeys(("gradient_accumulation_steps", "grad_accumulation_steps", "gradient_accumulation",
                     "accumulate_grad_batches"), "optim.grad_accum"),
    **dict.fromkeys(("num_epochs", "num_train_epochs", "n_epochs", "epoch"), "optim.epochs"),
    **dict.fromkeys(("num_steps", "train_steps", "total_steps", "max_iters", "num_training_steps"), "optim.max_steps"),
    **dict.fromkeys(("max_seq_length", "cutoff_len", "max_length", "max_seq_len", "seq_length", "sequence_len",
                     "model_max_length", "max_source_length", "max_len"), "data.max_example_tokens"),
    **dict.fromkeys(("adam_beta1", "adam_beta2", "beta1", "beta2"), "optim.betas"),
    **dict.fromkeys(("adam_epsilon", "adam_eps"), "optim.eps"),
    **dict.fromkeys(("gradient_clipping", "clip_grad_norm", "grad_clip", "max_norm"), "optim.max_grad_norm"),
    **dict.fromkeys(("lora_r", "r"), "lora.rank"),
    "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout", "lora_target_modules": "lora.target_modules",
    **dict.fromkeys(("use_lora", "lora", "peft"), "lora.enabled"),
    **dict.fromkeys(("model_name_or_path", "pretrained_model_name_or_path", "model_name", "model_path", "model_id",
                     "base_model"), "model.name_or_path"),
    **dict.fromkeys(("output_dir", "save_dir", "checkpoint_dir", "out_dir"), "run.storage_root"),
    "run_name": "run.name", "experiment_name": "tracking.experiment",
    **dict.fromkeys(("save_steps", "save_every", "checkpoint_every"), "checkpoint.every_steps"),
    **dict.fromkeys(("save_total_limit", "keep_last"), "checkpoint.num_to_keep"),
    **dict.fromkeys(("eval_steps", "eval_every"), "eval.every_steps"),
    **dict.fromkeys(("logging_steps", "log_every", "log_steps"), "tracking.log_every_steps"),
    **dict.fromkeys(("fp16", "bf16", "mixed_precision", "dtype", "torch_dtype"), "deepspeed.precision"),
    **dict.fromkeys(("zero", "zero_optimization", "stage"), "deepspeed.zero_stage"),
    "gradient_checkpointing": "deepspeed.activation_checkpointing",
    **dict.fromkeys(("ds_config", "deepspeed_config"), "deepspeed.config_file"),
    **dict.fromkeys(("num_gpus", "n_gpus", "world_size", "nproc_per_node"), "scaling.num_workers"),
    **dict.fromkeys(("mlflow_tracking_uri", "tracking_url"), "tracking.tracking_uri"),
    **dict.fromkeys(("val_size", "validation_split", "val_split", "eval_split"), "data.val_fraction"),
    **dict.fromkeys(("dataset", "datasets", "data_files", "train_file"), "data.sources"),
    **dict.fromkeys(("pack_size", "max_pack_length"), "data.pack_tokens"),
}


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config section class in a field's type (``SourceConfig`` in ``list[SourceConfig]``), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model_in, typing.get_args(annotation)) if m is not None), None)


def unknown_field_hint(loc: tuple) -> str:
    """What to write instead of the unknown field at ``loc`` (pydantic's location of the error): an alias
    from another tool (:data:`FIELD_ALIASES`), the same name in another section, a near name in the same
    section (difflib), or else the section's fields."""
    import difflib

    model: type[BaseModel] | None = Config
    section = ""
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections (data.sources)
            section += f"[{part}]"
            continue
        field = model.model_fields.get(str(part)) if model else None
        model = _model_in(field.annotation) if field else None
        section = f"{section}.{part}" if section else str(part)
    key = str(loc[-1])
    if ":" in key:  # YAML reads "format:tsv" as one key: a mapping needs a space after its colon
        name, _, value = key.partition(":")
        return f"write '{name.strip()}: {value.strip()}' with a space after the colon (YAML)"
    known = list(model.model_fields) if model else []
    alias = FIELD_ALIASES.get(key.lower().replace("-", "_"))
    if alias and not section.endswith("]"):
        return f"did you mean {alias}?"
    prefix = f"{section}." if section else ""
    elsewhere = [f"{name}.{key}" for name, info in Config.model_fields.items()
                 if (sub := _model_in(info.annotation)) is not None and key in sub.model_fields and name != section]
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if elsewhere and not near:
        return f"did you mean {' or '.join(elsewhere)}?"
    if near:
        return f"did you mean {prefix}{near[0]}?"
    return f"{section or 'the top level'} has: {', '.join(known)}"


def _format_validation_error(err: ValidationError, source: str, overrides: list[str]) -> str:
    """One line per bad field, each saying where its value came from: ``--set field=value`` or the file."""
    lines = ["invalid configuration:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"])
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f"got {value!r}, "
        # A section-level rule (loc "data") may involve the file's values and a --set alike.
        # ... and a --set of a whole section or list (data.sources=[...]) sets every field inside it.
        setters = [o for o in overrides if field and ((key := o.split("=", 1)[0].strip() + ".").startswith(field + ".")
                                                      or (field + ".").startswith(key))]
        origin = ", ".join(f"--set {o}" for o in setters) or source
        msg, hint = e["msg"], ""
        if e["type"] == "extra_forbidden":
            msg, hint = "unknown field", f"; {unknown_field_hint(tuple(e['loc']))}"
        lines.append(f"  {field or '(top level)'}: {msg} ({shown}from {origin}){hint}")
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
