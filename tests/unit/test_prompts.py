import numpy as np
import pytest

from raytrain_hymt.data.prompts import build_prompt, expand_directions
from raytrain_hymt.languages import UnsupportedLanguageError


@pytest.mark.parametrize(
    "src, tgt, text, expected",
    [
        ("en", "zh", "It’s on the house.", "把下面的文本翻译成中文，不要额外解释。\n\nIt’s on the house."),
        ("zh", "en", "这是免费的。", "把下面的文本翻译成英语，不要额外解释。\n\n这是免费的。"),
        ("en", "zh-Hant", "Thanks.", "把下面的文本翻译成繁体中文，不要额外解释。\n\nThanks."),
        ("yue", "en", "唔該。", "把下面的文本翻译成英语，不要额外解释。\n\n唔該。"),
        ("en", "yue", "Thanks.", "把下面的文本翻译成粤语，不要额外解释。\n\nThanks."),
        ("zh", "ja", "你好。", "把下面的文本翻译成日语，不要额外解释。\n\n你好。"),
        (
            "en", "de", "Good morning.",
            "Translate the following segment into German, without additional explanation.\n\nGood morning.",
        ),
        (
            "de", "fr", "Guten Morgen.",
            "Translate the following segment into French, without additional explanation.\n\nGuten Morgen.",
        ),
        (
            "ja", "tl", "おはよう。",
            "Translate the following segment into Filipino, without additional explanation.\n\nおはよう。",
        ),
    ],
)  # fmt: skip
def test_build_prompt_exact(src, tgt, text, expected):
    assert build_prompt(text, src, tgt) == expected


def test_build_prompt_accepts_corpus_labels():
    expected = "把下面的文本翻译成繁体中文，不要额外解释。\n\nHi."
    assert build_prompt("Hi.", "eng_Latn", "cmn_Hant") == expected
    assert build_prompt("Hi.", "en-US", "pt-BR") == (
        "Translate the following segment into Portuguese, without additional explanation.\n\nHi."
    )


def test_build_prompt_keeps_source_verbatim():
    # Braces and newlines in the source are data, not template fields.
    text = "{target_language} {0} %s\nline two"
    assert build_prompt(text, "en", "zh").endswith("\n\n" + text)


def test_build_prompt_refuses_unsupported_languages():
    with pytest.raises(UnsupportedLanguageError):
        build_prompt("Hi.", "en", "wuu")
    with pytest.raises(UnsupportedLanguageError):
        build_prompt("Ni hao.", "cmn_Latn", "en")


def _rows():
    return {
        "src": ["Hello.", "Good night."],
        "tgt": ["你好。", "晚安。"],
        "src_lang": ["en", "en"],
        "tgt_lang": ["zh", "zh-Hant"],
        "example_id": [11, 12],
        "origin": ["a.tsv:1", "a.tsv:2"],
    }


def test_expand_one_direction_adds_direction_column_only():
    rows = _rows()
    assert expand_directions(rows, both_directions=False) == {**rows, "direction": [0, 0]}


def test_expand_both_directions_appends_reversed_pairs():
    out = expand_directions(_rows(), both_directions=True)
    assert out == {
        "src": ["Hello.", "Good night.", "你好。", "晚安。"],
        "tgt": ["你好。", "晚安。", "Hello.", "Good night."],
        "src_lang": ["en", "en", "zh", "zh-Hant"],
        "tgt_lang": ["zh", "zh-Hant", "en", "en"],
        "example_id": [11, 12, 11, 12],
        "origin": ["a.tsv:1", "a.tsv:2", "a.tsv:1", "a.tsv:2"],
        "direction": [0, 0, 1, 1],
    }
    keys = list(zip(out["example_id"], out["direction"]))
    assert len(set(keys)) == len(keys)


def test_expand_does_not_mutate_input_and_takes_numpy_columns():
    rows = {name: np.array(values, dtype=object) for name, values in _rows().items()}
    out = expand_directions(rows, both_directions=True)
    assert len(rows["src"]) == 2
    assert out["src"] == ["Hello.", "Good night.", "你好。", "晚安。"]
    assert out["direction"] == [0, 0, 1, 1]


def test_expand_empty_batch():
    empty = {"src": [], "tgt": [], "src_lang": [], "tgt_lang": []}
    assert expand_directions(empty, both_directions=True) == {**empty, "direction": []}


def test_expand_refuses_a_second_pass_and_missing_columns():
    once = expand_directions(_rows(), both_directions=True)
    with pytest.raises(ValueError, match="once"):
        expand_directions(once, both_directions=True)
    with pytest.raises(ValueError, match="tgt_lang"):
        expand_directions({"src": [], "tgt": [], "src_lang": []}, both_directions=False)
