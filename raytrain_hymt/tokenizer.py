"""The tokenizer: a local folder or hub id, or the tiny offline stand-in (a byte-level BPE trained on the
bundled sample corpus, saved with a chat template in Hunyuan's turn format), and the ``model.name_or_path``
values with a meaning of their own. Tokenizing needs none of the model code: the data layer loads it from
here. (transformers' ``AutoTokenizer`` still imports torch, ~2 CPU-s per tokenizer actor on a 2-core CPU machine.)"""

from __future__ import annotations

from pathlib import Path

#: ``model.name_or_path`` value that selects the tiny offline model and tokenizer.
TINY_MODEL = "tiny"
TINY_TOKENIZER_DIR = Path(__file__).parent / "assets" / "tiny-tokenizer"

# Hunyuan dense turn format (Tencent's official finetune.py and LLaMA-Factory's `hunyuan` template):
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



#: ``model.name_or_path`` prefix of a random-init model built from a ``config.json`` (benchmarks: no
#: download, no weights): ``random:/path/to/config.json``.
RANDOM_PREFIX = "random:"


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
