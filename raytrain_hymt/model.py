"""Load the model and tokenizer: a local folder or hub id, or the tiny offline stand-ins.

The tiny model is a random-init ``hunyuan_v1_dense`` (the real Hunyuan-MT architecture, a few million
parameters) and the tiny tokenizer a byte-level BPE trained on the bundled sample corpus, saved with a
chat template in Hunyuan's turn format. They run through exactly the code path the real model uses.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: ``model.name_or_path`` value that selects the tiny offline model and tokenizer.
TINY_MODEL = "tiny"
TINY_TOKENIZER_DIR = Path(__file__).parent / "assets" / "tiny-tokenizer"

# Hunyuan dense turn format (FACTS.md; the official finetune.py and LLaMA-Factory's `hunyuan` template):
# <|startoftext|> + system{c}<|extra_4|> + user{c}<|extra_0|> + assistant{c}<|eos|>.
# A generation prompt adds nothing: the model answers right after <|extra_0|>.
HUNYUAN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}<|extra_4|>"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}<|extra_0|>"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
TINY_SPECIAL_TOKENS = ["<|startoftext|>", "<|eos|>", "<|pad|>", "<|extra_0|>", "<|extra_4|>"]


def build_tiny_tokenizer(lines: list[str], vocab_size: int = 4000):
    """Train the tiny byte-level BPE tokenizer on ``lines`` (deterministic for the same lines)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|startoftext|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = HUNYUAN_CHAT_TEMPLATE
    return fast


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


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """The tokenizer of ``name_or_path`` (``"tiny"``: the bundled one), with a pad token guaranteed."""
    from transformers import AutoTokenizer

    path = str(TINY_TOKENIZER_DIR) if name_or_path == TINY_MODEL else name_or_path
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        # Padding positions are masked out of attention and loss, so eos is a safe stand-in.
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        raise ValueError(f"tokenizer at {path!r} has no chat template; Hunyuan-MT prompts need one")
    return tok


def padded_vocab_size(tokenizer, multiple: int = 64) -> int:
    """Embedding rows for ``tokenizer``: its length rounded up to ``multiple`` (matmul-friendly)."""
    n = len(tokenizer)
    return (n + multiple - 1) // multiple * multiple


def load_model(
    name_or_path: str,
    tokenizer,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    seed: int = 0,
):
    """The causal LM to fine-tune: pretrained weights from a folder or hub id, or the tiny random model.

    Hunyuan-MT is a causal LM (``HunYuanDenseV1ForCausalLM``), never seq2seq. Its shape is read from the
    checkpoint's own config.json, so tied/untied embeddings and the vocabulary follow the files.
    """
    from transformers import AutoModelForCausalLM

    if name_or_path == TINY_MODEL:
        torch.manual_seed(seed)
        cfg = tiny_model_config(
            padded_vocab_size(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        cfg._attn_implementation = attn_implementation
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
