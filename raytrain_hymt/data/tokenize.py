"""Turn cleaned pairs into token ids and labels through the tokenizer's own chat template.

The prompt (user turn) and the answer are rendered by the chat template, so the real Hunyuan-MT
tokenizer and the tiny offline one go through the same code. Labels are -100 on the prompt; the loss
falls only on the answer and the template's end-of-turn token (Hunyuan: ``<|eos|>``).
"""

from __future__ import annotations

import numpy as np

from raytrain_hymt.data.prompts import build_prompt

IGNORE_INDEX = -100
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


def encode_pairs(
    tokenizer, prompts: list[str], answers: list[str], suffix: str
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and labels of ``prompt → answer`` examples (labels -100 on the prompt)."""
    if not prompts:
        return [], []  # a batch whose rows were all dropped (the tokenizer rejects an empty list)
    prompt_ids = tokenizer(render_prompts(tokenizer, prompts), add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer([a + suffix for a in answers], add_special_tokens=False)["input_ids"]
    input_ids, labels = [], []
    for p, a in zip(prompt_ids, answer_ids):
        input_ids.append(np.asarray(p + a, dtype=np.int32))
        labels.append(np.asarray([IGNORE_INDEX] * len(p) + a, dtype=np.int32))
    return input_ids, labels


class TokenizePairs:
    """Ray Data actor: one tokenizer per actor (a shared tokenizer fails with "Already borrowed")."""

    def __init__(self, tokenizer_name: str, max_example_tokens: int, trust_remote_code: bool = False):
        from raytrain_hymt.model import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_name, trust_remote_code=trust_remote_code)
        self.suffix = answer_suffix(self.tokenizer)
        self.max_tokens = max_example_tokens

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = len(batch["src"])
        drop = [str(r) for r in batch["drop_reason"]]
        keep = [i for i in range(n) if not drop[i]]
        prompts = [build_prompt(str(batch["src"][i]), str(batch["src_lang"][i]), str(batch["tgt_lang"][i])) for i in keep]
        ids, labels = encode_pairs(self.tokenizer, prompts, [str(batch["tgt"][i]) for i in keep], self.suffix)
        empty = np.zeros(0, dtype=np.int32)
        out_ids = [empty] * n
        out_labels = [empty] * n
        for i, x, y in zip(keep, ids, labels):
            if len(x) > self.max_tokens:
                drop[i] = "too_many_tokens"
            else:
                out_ids[i], out_labels[i] = x, y
        out = dict(batch)
        out["input_ids"] = _object_array(out_ids)
        out["labels"] = _object_array(out_labels)
        out["num_tokens"] = np.array([len(x) for x in out_ids], dtype=np.int32)
        out["drop_reason"] = np.array(drop, dtype=object)
        return out


def _object_array(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.empty(len(arrays), dtype=object)
    out[:] = arrays
    return out
