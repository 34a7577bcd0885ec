"""Turn cleaned pairs into token ids and labels through the tokenizer's own chat template.

The prompt (user turn) and the answer are rendered by the chat template, so the real Hunyuan-MT
tokenizer and the tiny offline one go through the same code. Labels are -100 on the prompt; the loss
falls only on the answer and the template's end-of-turn token (Hunyuan: ``<|eos|>``).

Token columns leave the tokenizer as Arrow ``list<int32>`` arrays built from one flat buffer per batch:
Ray Data stores, sorts and slices those without a Python object per example (object arrays of NumPy
arrays become variable-shaped tensor columns, converted element by element at every stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import pyarrow as pa

from raytrain_hymt.data.packing import IGNORE_INDEX
from raytrain_hymt.data.prompts import DEFAULT_FAMILY, KIND_FIELDS, build_prompt
#: Columns the tokenizer consumes: its output keeps every other input column plus the token columns.
TEXT_COLUMNS = ("src", "tgt", "src_lang", "tgt_lang")
_PROBE = "\x00ANSWER\x00"


def answer_suffix(tokenizer) -> str:
    """What the chat template writes after an assistant answer (its end-of-turn marker)."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}], tokenize=False
    )
    suffix = rendered.split(_PROBE, 1)[1]
    if not suffix:
        # A template that ends the answer with nothing would teach the model never to stop.
        suffix = tokenizer.eos_token
    return suffix


def render_prompts(tokenizer, prompts: list[str]) -> list[str]:
    """Each user message rendered as the start of a chat, up to where the model's answer begins."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]


def token_lists(tokenizer, prompts: list[str], answers: list[str], suffix: str) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids of the rendered prompts, and of the answers followed by ``suffix``."""
    if not prompts:
        return [], []  # a batch whose rows were all dropped (the tokenizer rejects an empty list)
    prompt_ids = tokenizer(render_prompts(tokenizer, prompts), add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer([a + suffix for a in answers], add_special_tokens=False)["input_ids"]
    return prompt_ids, answer_ids


def encode_pairs(
    tokenizer, prompts: list[str], answers: list[str], suffix: str
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and labels of ``prompt → answer`` examples (labels -100 on the prompt), one int32 array
    per example (the pipeline builds Arrow columns instead: :func:`example_columns`)."""
    input_ids, labels = [], []
    for p, a in zip(*token_lists(tokenizer, prompts, answers, suffix)):
        input_ids.append(np.asarray(p + a, dtype=np.int32))
        labels.append(np.asarray([IGNORE_INDEX] * len(p) + a, dtype=np.int32))
    return input_ids, labels


def example_columns(prompt_ids: Sequence[Sequence[int]], answer_ids: Sequence[Sequence[int]], max_tokens: int) -> dict:
    """The token columns of ``prompt → answer`` examples.

    Returns ``input_ids`` (prompt then answer) and ``labels`` (-100 on the prompt, the answer ids after
    it) as Arrow ``list<int32>`` arrays, ``num_tokens`` and ``num_targets`` (answer tokens: exactly the
    labels that are not -100) as int32 arrays, and ``too_long``: the examples over ``max_tokens``, which
    are left empty (no tokens, no targets), like rows with no prompt and no answer.
    """
    n_prompt = np.fromiter(map(len, prompt_ids), dtype=np.int64, count=len(prompt_ids))
    n_answer = np.fromiter(map(len, answer_ids), dtype=np.int64, count=len(answer_ids))
    too_long = n_prompt + n_answer > max_tokens
    n_prompt[too_long] = n_answer[too_long] = 0
    lengths = n_prompt + n_answer
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    keep = (~too_long).tolist()
    pieces = chain.from_iterable((p, a) for p, a, k in zip(prompt_ids, answer_ids, keep) if k)
    ids = np.fromiter(chain.from_iterable(pieces), dtype=np.int32, count=int(offsets[-1]))
    # A token is on the prompt when its position within its example is below the prompt's length.
    position = np.arange(ids.size) - np.repeat(offsets[:-1], lengths)
    labels = np.where(position < np.repeat(n_prompt, lengths), np.int32(IGNORE_INDEX), ids)
    arrow_offsets = pa.array(offsets, pa.int32())
    return {
        "input_ids": pa.ListArray.from_arrays(arrow_offsets, pa.array(ids, pa.int32())),
        "labels": pa.ListArray.from_arrays(arrow_offsets, pa.array(labels, pa.int32())),
        "num_tokens": lengths.astype(np.int32),
        "num_targets": n_answer.astype(np.int32),
        "too_long": too_long,
    }


class TokenizePairs:
    """Ray Data actor: one tokenizer per actor (a shared tokenizer fails with "Already borrowed").

    Takes a NumPy batch of pairs, returns an Arrow table: the input columns but :data:`TEXT_COLUMNS`,
    plus :func:`example_columns`' ``input_ids``, ``labels``, ``num_tokens`` and ``num_targets``; rows
    already dropped stay (no tokens), examples over ``max_example_tokens`` become ``too_many_tokens``.
    """

    def __init__(self, tokenizer_name: str, max_example_tokens: int, trust_remote_code: bool = False,
                 family: str = DEFAULT_FAMILY):
        from raytrain_hymt.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_name, trust_remote_code=trust_remote_code)
        self.suffix = answer_suffix(self.tokenizer)
        self.max_tokens = max_example_tokens
        self.family = family

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        n = len(batch["src"])
        drop = [str(r) for r in batch["drop_reason"]]
        keep = [i for i in range(n) if not drop[i]]
        # Optional per-example fields (terms, context...) choose the prompt kind; absent columns give plain.
        kind_columns = {name: batch[name] for name in KIND_FIELDS if name in batch}
        prompts = [build_prompt(str(batch["src"][i]), str(batch["src_lang"][i]), str(batch["tgt_lang"][i]),
                                self.family, **{name: col[i] for name, col in kind_columns.items()}) for i in keep]
        kept_prompts, kept_answers = token_lists(self.tokenizer, prompts, [str(batch["tgt"][i]) for i in keep], self.suffix)
        prompt_ids: list[list[int]] = [[]] * n
        answer_ids: list[list[int]] = [[]] * n
        for i, p, a in zip(keep, kept_prompts, kept_answers):
            prompt_ids[i], answer_ids[i] = p, a
        columns = example_columns(prompt_ids, answer_ids, self.max_tokens)
        for i in np.flatnonzero(columns.pop("too_long")).tolist():
            drop[i] = "too_many_tokens"
        out = {k: pa.array(v, pa.string() if v.dtype == object else None) for k, v in batch.items()
               if k not in TEXT_COLUMNS and k not in KIND_FIELDS and k != "drop_reason"}
        out["drop_reason"] = pa.array(drop, pa.string())
        out.update(columns)
        return pa.table(out)
