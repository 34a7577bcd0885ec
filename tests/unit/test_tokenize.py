"""The prompt/label layout of a tokenized pair, decoded and checked token by token with the tiny tokenizer
(which uses Hunyuan's turn format: ``<|startoftext|>`` user ``<|extra_0|>`` assistant ``<|eos|>``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from raytrain_hymt.data.prompts import build_prompt
from raytrain_hymt.data.tokenize import (
    IGNORE_INDEX,
    TokenizePairs,
    answer_suffix,
    encode_pairs,
    example_columns,
    render_prompts,
    token_lists,
)
from raytrain_hymt.tokenizer import load_tokenizer


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
    # The pipeline's Arrow columns hold the same tokens and labels.
    columns = example_columns(*token_lists(tok, [prompt], [tgt], answer_suffix(tok)), max_tokens=256)
    assert columns["input_ids"][0].as_py() == ids.tolist() and columns["labels"][0].as_py() == labels.tolist()
    assert columns["num_tokens"].tolist() == [len(ids)] and columns["num_targets"].tolist() == [len(answer_ids)]
    n = len(prompt_ids)
    # Token by token: no loss anywhere on the prompt, loss on every answer token and the end of turn.
    for i, (token, label) in enumerate(zip(ids.tolist(), labels.tolist())):
        assert label == (IGNORE_INDEX if i < n else token), f"position {i} ({tok.decode([token])!r})"
    assert tok.decode(ids[:n].tolist()) == prompt_text
    assert tok.decode([t for t in labels.tolist() if t != IGNORE_INDEX]) == tgt + "<|eos|>"
    assert ids[0] == tok.convert_tokens_to_ids("<|startoftext|>")
    assert ids[n - 1] == tok.convert_tokens_to_ids("<|extra_0|>")
    assert labels[-1] == ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|eos|>")


def test_example_columns_exact_outputs():
    out = example_columns([[1, 2], [], [3], [4, 5, 6]], [[7], [], [8, 9], [10]], max_tokens=3)
    assert out["input_ids"].type == out["labels"].type == pa.list_(pa.int32())
    assert out["input_ids"].to_pylist() == [[1, 2, 7], [], [3, 8, 9], []]
    assert out["labels"].to_pylist() == [[-100, -100, 7], [], [-100, 8, 9], []]
    assert out["num_tokens"].tolist() == [3, 0, 3, 0] and out["num_targets"].tolist() == [1, 0, 2, 0]
    assert out["too_long"].tolist() == [False, False, False, True]  # 4 tokens > 3: left empty
    empty = example_columns([], [], max_tokens=3)
    assert len(empty["input_ids"]) == 0 and empty["num_tokens"].tolist() == []


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
    assert out.column_names == ["example_id", "drop_reason", "input_ids", "labels", "num_tokens", "num_targets"]
    assert out["drop_reason"].to_pylist() == ["", "malformed", "too_many_tokens"]
    assert out["example_id"].to_pylist() == [1, 2, 3]
    [p], [a] = token_lists(tok, [build_prompt("Hello.", "en", "zh")], ["你好。"], "<|eos|>")
    assert out["input_ids"][0].as_py() == p + a and out["labels"][0].as_py() == [IGNORE_INDEX] * len(p) + a
    assert out["num_tokens"].to_pylist() == [len(p) + len(a), 0, 0]
    assert out["num_targets"].to_pylist() == [len(a), 0, 0]
    assert out["input_ids"][1].as_py() == out["input_ids"][2].as_py() == []
