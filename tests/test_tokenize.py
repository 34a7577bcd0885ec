"""The prompt/label layout of a tokenized pair, decoded and checked token by token with the tiny tokenizer
(which uses Hunyuan's turn format: ``<|startoftext|>`` user ``<|extra_0|>`` assistant ``<|eos|>``)."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_hymt.data.prompts import build_prompt
from raytrain_hymt.data.tokenize import IGNORE_INDEX, TokenizePairs, answer_suffix, encode_pairs, render_prompts
from raytrain_hymt.model import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


def test_answer_suffix_is_the_end_of_turn_token(tok):
    assert answer_suffix(tok) == "<|eos|>"


@pytest.mark.parametrize(
    ("src", "src_lang", "tgt", "tgt_lang", "prompt_text"),
    [
        ("Hello there.", "en", "你好。", "zh",
         "<|startoftext|>把下面的文本翻译成中文，不要额外解释。\n\nHello there.<|extra_0|>"),
        ("Guten Morgen.", "de", "Good morning.", "en",
         "<|startoftext|>Translate the following segment into English, without additional explanation.\n\n"
         "Guten Morgen.<|extra_0|>"),
    ],
)
def test_prompt_and_labels_token_by_token(tok, src, src_lang, tgt, tgt_lang, prompt_text):
    prompt = build_prompt(src, src_lang, tgt_lang)
    assert render_prompts(tok, [prompt]) == [prompt_text]
    [ids], [labels] = encode_pairs(tok, [prompt], [tgt], answer_suffix(tok))
    prompt_ids = tok(prompt_text, add_special_tokens=False)["input_ids"]
    answer_ids = tok(tgt + "<|eos|>", add_special_tokens=False)["input_ids"]
    assert ids.dtype == labels.dtype == np.int32
    assert ids.tolist() == prompt_ids + answer_ids
    n = len(prompt_ids)
    # Token by token: no loss anywhere on the prompt, loss on every answer token and the end of turn.
    for i, (token, label) in enumerate(zip(ids.tolist(), labels.tolist())):
        assert label == (IGNORE_INDEX if i < n else token), f"position {i} ({tok.decode([token])!r})"
    assert tok.decode(ids[:n].tolist()) == prompt_text
    assert tok.decode([t for t in labels.tolist() if t != IGNORE_INDEX]) == tgt + "<|eos|>"
    assert ids[0] == tok.convert_tokens_to_ids("<|startoftext|>")
    assert ids[n - 1] == tok.convert_tokens_to_ids("<|extra_0|>")
    assert labels[-1] == ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|eos|>")


def test_tokenize_actor_keeps_dropped_rows_and_drops_long_examples(tok):
    batch = {
        "src": np.array(["Hello.", "x", "word " * 60], dtype=object),
        "tgt": np.array(["你好。", "", "词" * 60], dtype=object),
        "src_lang": np.array(["en", "", "en"], dtype=object),
        "tgt_lang": np.array(["zh", "", "zh"], dtype=object),
        "drop_reason": np.array(["", "malformed", ""], dtype=object),
        "example_id": np.array([1, 2, 3], dtype=np.int64),
    }
    out = TokenizePairs("tiny", max_example_tokens=64)(batch)
    assert out["drop_reason"].tolist() == ["", "malformed", "too_many_tokens"]
    assert out["example_id"].tolist() == [1, 2, 3]
    [ids], [labels] = encode_pairs(tok, [build_prompt("Hello.", "en", "zh")], ["你好。"], "<|eos|>")
    assert out["input_ids"][0].tolist() == ids.tolist() and out["labels"][0].tolist() == labels.tolist()
    assert out["num_tokens"].tolist() == [len(ids), 0, 0]
    assert len(out["input_ids"][1]) == len(out["input_ids"][2]) == 0
