"""The configuration's sections for what is trained and how: data, model, optimizer, DeepSpeed, LoRA.

Part of the typed configuration tree of :mod:`raytrain_hymt.config` (each field documented, validated and
defaulted once, here); the sections for where and how a run runs are :mod:`raytrain_hymt.config_run`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raytrain_hymt.errors import ConfigError



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
    max_bad_fraction: float = Field(0.01, ge=0, le=1)
    """Fail when more than this share of lines is malformed or not valid UTF-8 (below it: counted)."""
    packing: bool = True
    """Pack several examples per row with document-masked attention (fast); off: one padded example
    per row (the tutorial's way)."""
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
    """Data type of gradient all-reduce (the tutorial's fp16 compression hook, DeepSpeed's way);
    None: the training precision."""
    activation_checkpointing: bool = False
    """Recompute activations in backward (less memory, ~30% more compute)."""
    reduce_bucket_size: int = Field(200_000_000, ge=1)
    """Elements per gradient reduction bucket."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward."""
    config_file: str | None = None
    """A DeepSpeed JSON of your own (the tutorial's ``ds_config.json`` style; "auto" values are filled
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
