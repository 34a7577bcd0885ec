"""Load the model and tokenizer: a local folder or hub id, or the tiny offline stand-ins.

The tiny model is a random-init ``hunyuan_v1_dense`` (the real Hunyuan-MT architecture, a few million
parameters) and the tiny tokenizer a byte-level BPE trained on the bundled sample corpus, saved with a
chat template in Hunyuan's turn format. They run through exactly the code path the real model uses.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from raytrain_hymt.evaluation.generation import DTYPES, Generator
from raytrain_hymt.tokenizer import RANDOM_PREFIX, TINY_MODEL, padded_vocab_size

log = logging.getLogger(__name__)


def tiny_model_config(vocab_size: int, **overrides):
    """Config of the tiny random-init Hunyuan dense model (same architecture as Hunyuan-MT-7B)."""
    from transformers import HunYuanDenseV1Config

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    shape.update(overrides)
    return HunYuanDenseV1Config(**shape)


def load_model(
    name_or_path: str,
    tokenizer,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    seed: int = 0,
    device: torch.device | str | None = None,
):
    """The causal LM to fine-tune: pretrained weights from a folder or hub id, or the tiny random model.

    Hunyuan-MT is a causal LM (``HunYuanDenseV1ForCausalLM``), never seq2seq. Its shape is read from the
    checkpoint's own config.json, so tied/untied embeddings and the vocabulary follow the files.
    ``random:<config.json>`` builds a random-init model of that shape on ``device`` (benchmarks).
    """
    from transformers import AutoModelForCausalLM

    # One seed for everything random from here on: random-init weights, LoRA adapters, dropout.
    torch.manual_seed(seed)
    if name_or_path.startswith(RANDOM_PREFIX):
        model = _random_model(name_or_path[len(RANDOM_PREFIX):], tokenizer, dtype, attn_implementation, device)
    elif name_or_path == TINY_MODEL:
        cfg = tiny_model_config(
            padded_vocab_size(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model




def hunyuan_7b_config(layers: int = 32, tie_word_embeddings: bool = True, **overrides) -> dict:
    """``config.json`` contents of the Hunyuan-7B shape (as in Hunyuan-MT-7B's own config.json): hidden 4096, 32 heads, 8 KV heads,
    head_dim 128, intermediate 14336, vocab 128167; tied embeddings give 7.50 B parameters, untied 8.03 B.
    ``layers`` < 32 gives the full-width, reduced-depth models that benchmarks screen levers on."""
    shape = dict(
        model_type="hunyuan_v1_dense", vocab_size=128167, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-5, use_qk_norm=True, tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=127961, eos_token_id=127960,
    )
    shape.update(overrides)
    return shape


def _random_model(config_json: str, tokenizer, dtype: torch.dtype, attn_implementation: str, device):
    """A random-init causal LM of the shape in ``config_json``, built directly on ``device``."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(config_json)
    if not path.is_file():
        raise ValueError(f"model.name_or_path {RANDOM_PREFIX}{config_json}: no such config.json file")
    fields = json.loads(path.read_text())
    if fields.get("vocab_size", 0) < len(tokenizer):
        raise ValueError(f"{path}: vocab_size {fields.get('vocab_size')} is smaller than the tokenizer ({len(tokenizer)})")
    cfg = AutoConfig.for_model(**fields)
    # Initialising 7 B parameters on the GPU takes seconds; on the CPU, minutes.
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)


class FusedLinearCrossEntropy(torch.nn.Module):
    """Output head + summed shifted cross-entropy in one chunked kernel (Liger), never materialising the
    ``[tokens, vocab]`` logits (128k vocabulary: ~1 GiB per 4096 tokens in bf16, twice that in fp32).
    Holds no parameters of its own: it reads the output head's weight, which ZeRO-3 gathers for it."""

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return liger_fused_linear_cross_entropy(h, weight, labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")


def use_fused_loss(model):
    """Make ``model(..., labels=L)`` return the summed token loss of :func:`token_loss_sum` through
    :class:`FusedLinearCrossEntropy` instead of logits (GPU only: Liger's kernels are Triton). Without
    ``labels`` the model behaves as before (validation, generation); saved weights do not change."""
    import importlib.util
    import types

    import deepspeed

    if importlib.util.find_spec("liger_kernel") is None:
        # Checked here, before the first step, so a missing package costs seconds, not a loaded 7B model.
        raise ImportError("model.fused_loss needs the liger-kernel package: pip install 'raytrain_hymt[gpu]'")
    head = model.get_output_embeddings()
    model.fused_loss = FusedLinearCrossEntropy()
    # Under ZeRO-3 the head's weight is only gathered inside the head's own forward; this gathers it
    # for the fused loss module's forward too (a no-op for other stages).
    deepspeed.zero.register_external_parameter(model.fused_loss, head.weight)
    plain_forward = model.forward

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, labels=None, **kwargs):
        if labels is None:
            return plain_forward(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, **kwargs)
        hidden = self.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                    **kwargs).last_hidden_state
        return self.fused_loss(hidden, self.get_output_embeddings().weight, labels)

    model.forward = types.MethodType(forward, model)
    return model


#: The frozen output projection's weight is stored in a multiple of this many rows (see :func:`align_frozen_head`).
HEAD_ROW_MULTIPLE = 64


def align_frozen_head(model) -> bool:
    """Store a frozen output projection's weight in a multiple of :data:`HEAD_ROW_MULTIPLE` rows (the extra
    rows zero) and multiply with all of them, keeping the vocabulary's columns of the result; returns
    whether it did. The parameter itself keeps its shape and values (checkpoints, export and the state
    dict see no change), and the logits are the same dot products.

    Why: Hunyuan's vocabulary has 128,167 entries, an odd row count, so the logits (and their gradient)
    have an odd leading dimension and cuBLAS falls back to unaligned pre-Hopper kernels for the head's
    matmuls: on one H200 they took 310 ms of a 1.29 s LoRA step, at 111 TFLOP/s
    (``jobs/benchmark.py --profile``, README "One H200"). A trained head (full fine-tuning) lives in
    DeepSpeed's flat buffers and is left alone, as is a ZeRO-3 partitioned one."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if (weight is None or weight.requires_grad or getattr(head, "bias", None) is not None or weight.dim() != 2
            or hasattr(weight, "ds_id") or weight.shape[0] % HEAD_ROW_MULTIPLE == 0):
        return False
    rows = -(-weight.shape[0] // HEAD_ROW_MULTIPLE) * HEAD_ROW_MULTIPLE
    padded = torch.zeros((rows, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    padded[: weight.shape[0]].copy_(weight.detach())
    weight.data = padded[: weight.shape[0]]  # tied input embeddings share the parameter, and so this storage
    head.forward = _AlignedForward(head, rows)
    return True


class _AlignedForward:
    """The forward of a head aligned by :func:`align_frozen_head` (a plain ``linear`` again whenever the
    weight no longer sits in its padded storage, e.g. after a copy to another device)."""

    def __init__(self, head, rows: int):
        self.head, self.rows = head, rows

    def __call__(self, hidden):
        weight = self.head.weight
        cols = weight.shape[0]
        if weight.untyped_storage().nbytes() < self.rows * weight.shape[1] * weight.element_size() or \
                weight.storage_offset() or not weight.is_contiguous():
            return torch.nn.functional.linear(hidden, weight)
        full = weight.as_strided((self.rows, weight.shape[1]), weight.stride())
        return torch.nn.functional.linear(hidden, full)[..., :cols]


#: Prefix of the local copies replicas make of a model given as a URI (``<tempdir>/<prefix><token>-*``).
COPY_PREFIX = "hymt-eval-model-"


def local_model_path(model: str, token: str = "") -> str:
    """``model`` itself, or for a URI (``s3://``, ``gs://``, ``file://``) a local copy of that folder: a
    replica may run on any node, and only a shared path, a hub id or a URI reaches every node. ``token``
    names the evaluation the copy belongs to (its driver removes what its replicas leave on its node)."""
    from raytrain_hymt.storage import is_uri

    if not is_uri(model):
        return model
    import tempfile

    import pyarrow.fs

    fs, path = pyarrow.fs.FileSystem.from_uri(model)
    local = tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{token}-")
    pyarrow.fs.copy_files(path, local, source_filesystem=fs, destination_filesystem=pyarrow.fs.LocalFileSystem())
    return local


def load_generator(model: str, precision: str, max_new_tokens: int, use_gpu: bool,
                   trust_remote_code: bool = False, sample: bool = False, copy_token: str = "") -> Generator:
    """A :class:`Generator` for ``model`` (a folder, hub id, URI or ``tiny``) on GPU 0 or the CPU."""
    import transformers

    from raytrain_hymt.tokenizer import load_tokenizer

    transformers.utils.logging.disable_progress_bar()  # one bar per replica would clutter the job's log
    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    local = local_model_path(model, copy_token)
    tokenizer = load_tokenizer(local, trust_remote_code)
    loaded = load_model(local, tokenizer, dtype=DTYPES[precision], trust_remote_code=trust_remote_code,
                        device=device).to(device).eval()
    if local != model:
        # Loaded (a memory-mapped file stays readable after its unlink): free the disk (16 GB at 7B).
        shutil.rmtree(local, ignore_errors=True)
    return Generator(loaded, tokenizer, max_new_tokens, sample=sample)
