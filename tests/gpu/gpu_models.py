"""Helpers of the GPU suite (``make test-gpu``): the skip without CUDA, full-width Hunyuan-7B-shaped model
folders of reduced depth, real training rows, and a training ``Worker`` in this process.

Named apart from ``conftest`` so that ``from conftest import ...`` keeps finding tests/conftest.py.

What stands in for what: the model folders are random-init Hunyuan-7B shapes (hidden 4096, 32 heads, 8 KV
heads, head_dim 128, intermediate 14336, vocabulary 128,167, q/k norms, untied embeddings) with 2 layers
instead of 32, saved with the tiny tokenizer, loaded by ``from_pretrained`` as ``model.name_or_path``
makes every run load them. The in-process ``Worker`` tests run this pytest process as the one Ray Train
worker of a world of 1 (rank 0, an NCCL group of one): ``Worker`` itself only needs Ray Train to find a
checkpoint to resume from, which those tests never do. ``hymt train``, BLEU during training and
evaluation run through Ray for real.
"""

from __future__ import annotations

import functools
import os
import socket
import tempfile
from pathlib import Path

import numpy as np
import pytest

SKIP_REASON = "the GPU suite needs a CUDA GPU (make test-gpu)"


def skip_without_cuda() -> None:
    """Skip the calling test module when no CUDA GPU is present (CI, `make test`): nothing else runs."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip(SKIP_REASON, allow_module_level=True)
    # Engines of 1.5 B parameters are built and freed one after another in one process: without expandable
    # segments the freed blocks fragment the cache (30 GiB reserved but unusable was seen on an H100).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def scratch_root() -> Path:
    """Where model folders and run folders go: /dev/shm when it exists (a full-width model is 3 GB and a
    ZeRO checkpoint of it 21 GB: memory is faster than the disk), else the temp folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@functools.cache
def model_folder(layers: int = 2) -> str:
    """A Hunyuan-7B-shaped model folder of ``layers`` decoder layers (bf16, seed 0) with the tiny tokenizer:
    ``train/model.py``'s ``hunyuan_7b_config`` at reduced depth, untied, written once per process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from raytrain_hymt.tokenizer import load_tokenizer
    from raytrain_hymt.train.model import hunyuan_7b_config

    tok = load_tokenizer("tiny")
    folder = Path(tempfile.mkdtemp(prefix=f"hymt-gpu-{layers}l-", dir=scratch_root()))
    fields = hunyuan_7b_config(layers, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.bfloat16)
    with torch.no_grad():
        # The vocabulary beyond the tiny tokenizer's stays unused, as a padded vocabulary's rows are: greedy
        # decoding then emits tokens that decode to text.
        model.get_output_embeddings().weight[len(tok):] = 0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return str(folder)


@functools.cache
def sample_examples(n: int = 400) -> dict[str, np.ndarray]:
    """``n`` real eng→zh sample pairs tokenized through the chat template (prompts masked with -100)."""
    from raytrain_hymt.data.files import SAMPLE_CORPUS
    from raytrain_hymt.data.prompts import build_prompt
    from raytrain_hymt.data.tokenize import answer_suffix, encode_pairs
    from raytrain_hymt.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    lines = [line.split("\t") for line in SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()]
    pairs = [(src, tgt) for _, tgt_lang, src, tgt in lines if tgt_lang == "cmn_Hans"][:n]
    ids, labels = encode_pairs(tok, [build_prompt(s, "en", "zh") for s, _ in pairs], [t for _, t in pairs],
                               answer_suffix(tok))
    return {"input_ids": np.array(ids, dtype=object), "labels": np.array(labels, dtype=object),
            "example_id": np.arange(len(ids), dtype=np.int64)}


def packed_rows(rows: int, pack_tokens: int) -> dict[str, np.ndarray]:
    """The first ``rows`` packed rows (several documents each) of the sample pairs."""
    from raytrain_hymt.data.packing import pack_examples

    packed = pack_examples(sample_examples(), pack_tokens)
    assert len(packed["input_ids"]) >= rows, f"only {len(packed['input_ids'])} packed rows of {pack_tokens}"
    return {k: v[:rows] for k, v in packed.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_group() -> None:
    """This process as rank 0 of a world of 1 (NCCL), as Ray Train sets one up for a single GPU worker."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.cuda.set_device(0)
    deepspeed.init_distributed("nccl")


def train_config(**fields) -> dict:
    """A validated config on the GPU (bf16, flex attention, packed rows) from the 2-layer model folder."""
    from raytrain_hymt.config.schema import load_config

    values = {
        "model.name_or_path": model_folder(), "model.attn_implementation": "flex_attention",
        "scaling.use_gpu": True, "scaling.num_workers": 1, "deepspeed.precision": "bf16",
        "deepspeed.zero_stage": 2, "data.packing": True, "data.pack_tokens": 1024,
        "optim.micro_batch_size": 2, "optim.grad_accum": 1, "optim.max_steps": 4, "optim.lr": 1e-5,
        "optim.warmup_steps": 0, "optim.max_grad_norm": 1.0, "tracking.enabled": False,
    }
    values.update(fields)
    return load_config(None, [f"{k}={v}" for k, v in values.items()]).model_dump(mode="json")


def build_worker(run_dir: Path, **fields):
    """A built ``Worker`` (model and DeepSpeed engine on GPU 0) for ``train_config(**fields)``."""
    from raytrain_hymt.train.worker import LoopInputs, Worker

    single_process_group()
    w = Worker(LoopInputs(config=train_config(**fields), train_rows=64, tracking_run_id=None, tracking_uri=None,
                          run_dir=str(run_dir)), 0, 1)
    w.build(load_universal=False)  # a fresh run: nothing to resume, so Ray Train's checkpoint is not asked
    return w


def release(w) -> None:
    """Free a worker's engine and its GPU memory before the next one is built."""
    import gc

    import torch

    w.engine.destroy()
    w.engine.optimizer = None
    w.engine = None
    gc.collect()
    torch.cuda.empty_cache()


def rel_err(got, want) -> float:
    """‖got − want‖ / ‖want‖ in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())
