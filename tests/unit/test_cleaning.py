import dataclasses
from collections import Counter

import numpy as np
import pytest

from raytrain_hymt.data.cleaning import (
    DROP_REASONS,
    CleaningRules,
    DataQualityError,
    check_bad_fraction,
    clean_batch,
    format_sample,
    normalize_text,
    pair_key,
    split_key,
)
from raytrain_hymt.languages import UnsupportedLanguageError
from raytrain_hymt.data.files import SAMPLE_CORPUS


@pytest.fixture(scope="module")
def tatoeba_lines() -> list[list[str]]:
    """The real Tatoeba eng-zho test set (the bundled sample) as [src_lang, tgt_lang, src, tgt] rows (line n
    at index n-1)."""
    with SAMPLE_CORPUS.open(encoding="utf-8", newline="") as f:
        return [line.rstrip("\n").split("\t") for line in f]


def _batch(rows, **extra):
    batch = {name: [row[i] for row in rows] for i, name in enumerate(("src", "tgt", "src_lang", "tgt_lang"))}
    return {**batch, **extra}


def _tatoeba_batch(lines, numbers):
    rows = [(lines[n - 1][2], lines[n - 1][3], lines[n - 1][0], lines[n - 1][1]) for n in numbers]
    return _batch(rows, origin=[f"eng-zho.test.tsv:{n}" for n in numbers])


# --- normalize_text -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("e\u0301", "é"),  # NFC composes
        ("e\u200b\u0301", "é"),  # ...also once the zero-width space between them is gone
        ("a\u200bb\u2060c\ufeffd", "abcd"),
        ("\ufeffHello", "Hello"),
        ("  a\t\tb\nc\r\nd\u00a0e\u3000f\u2028g  ", "a b c d e f g"),
        ("a\x00b\x07c\x1bd\x7fe\x85f\x9fg", "a b c d e f g"),  # C0, DEL, C1 controls
        ("中文　标点，不变。", "中文 标点，不变。"),  # NFC, not NFKC: full-width punctuation stays
        ("می\u200cخواهم", "می\u200cخواهم"),  # Persian ZWNJ is spelling: kept
        ("\t \u3000\n", ""),
        ("", ""),
    ],
)
def test_normalize_text(raw, expected):
    assert normalize_text(raw) == expected


def test_normalize_removes_zero_width_spaces_of_real_line_809(tatoeba_lines):
    raw = tatoeba_lines[808][3]
    assert raw.count("\u200b") == 2
    assert normalize_text(raw) == "他好好的使用了這筆錢。"


def test_normalize_is_idempotent_on_the_real_corpus(tatoeba_lines):
    for row in tatoeba_lines:
        for text in row[2:]:
            once = normalize_text(text)
            assert normalize_text(once) == once


# --- CleaningRules --------------------------------------------------------------------------------


def test_rules_defaults_and_frozen():
    rules = CleaningRules()
    assert dataclasses.asdict(rules) == {
        "min_chars": 1, "max_chars": 1000, "max_length_ratio": 4.0, "ratio_min_chars": 10,
        "drop_identical": True, "on_unsupported_language": "drop", "language_id": True,
    }  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        rules.max_chars = 5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_chars": -1}, {"min_chars": 10, "max_chars": 5}, {"max_chars": 0}, {"max_length_ratio": 0.5},
        {"ratio_min_chars": -1}, {"on_unsupported_language": "skip"},
    ],
)  # fmt: skip
def test_rules_refuse_nonsense(kwargs):
    with pytest.raises(ValueError):
        CleaningRules(**kwargs)


# --- clean_batch ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, tgt, src_lang, tgt_lang, rules, reason",
    [
        ("Hello.", "你好。", "en", "zh", CleaningRules(), ""),
        ("Hello.", "侬好。", "eng", "wuu", CleaningRules(), "unsupported_language"),
        ("Ni hao.", "Hello.", "cmn_Latn", "eng", CleaningRules(), "unsupported_language"),
        ("", "", "en", "wuu", CleaningRules(), "unsupported_language"),  # language is checked first
        ("Hello.", " \u200b\t", "en", "zh", CleaningRules(), "empty"),
        (None, "你好。", "en", "zh", CleaningRules(), "empty"),
        ("Hi.", "嗨。", "en", "zh", CleaningRules(min_chars=3), "too_short"),
        ("Hello.", "你好。", "en", "zh", CleaningRules(min_chars=3), ""),
        ("Hello there.", "你好。", "en", "zh", CleaningRules(max_chars=10), "too_long"),
        ("x" * 1000, "y" * 251, "en", "de", CleaningRules(), ""),  # 1000 chars, ratio 3.98
        ("x" * 1001, "y" * 1001, "en", "de", CleaningRules(), "too_long"),
        ("Good morning to you all!!", "Hallo.", "en", "de", CleaningRules(), "length_ratio"),  # 25 / 6
        ("Good morning to you all!", "Hallo.", "en", "de", CleaningRules(), ""),  # 24 / 6: 4, not above
        # 39 Latin chars vs 9 Chinese: raw ratio 4.3, weighted 39 / 17 (8 CJK x 2 + "。") = 2.3
        ("A frog in a well knows nothing of seas.", "井底之蛙不知大海。", "en", "zh", CleaningRules(), ""),
        ("A frog in a well doesn't know the ocean.", "井底之蛙。", "en", "zh", CleaningRules(), "length_ratio"),
        ("Run away!", "跑", "en", "zh", CleaningRules(), ""),  # ratio 4.5, but the longer side has 9 < 10
        ("Run away!!", "跑", "en", "zh", CleaningRules(), "length_ratio"),  # 10 / 2
        ("Tom", "TOM ", "en", "de", CleaningRules(), "identical"),
        ("Tom", "TOM", "en", "de", CleaningRules(drop_identical=False), ""),
        ("Straße", "STRASSE", "de", "en", CleaningRules(), "identical"),  # casefold, not lower
    ],
)  # fmt: skip
def test_each_drop_reason(src, tgt, src_lang, tgt_lang, rules, reason):
    out = clean_batch(_batch([(src, tgt, src_lang, tgt_lang)]), rules)
    assert out["drop_reason"] == [reason]
    assert reason in DROP_REASONS + ("",)


def test_clean_batch_outputs_normalised_rows_canonical_codes_and_passthrough():
    batch = _batch(
        [
            ("  Hello,\tworld. ", "你好，\u200b世界。", "eng_Latn", "cmn_Hans"),
            ("Thank you.", "多謝。", "en-US", "yue_Hant"),
            ("Hello.", "你好。", "eng", "wuu"),
            (None, None, None, None),
        ],
        example_id=np.array([7, 8, 9, 10], dtype=np.int64),
        origin=["c.tsv:1", "c.tsv:2", "c.tsv:3", "c.tsv:4"],
    )
    out = clean_batch(batch, CleaningRules())
    assert out["src"] == ["Hello, world.", "Thank you.", "Hello.", ""]
    assert out["tgt"] == ["你好，世界。", "多謝。", "你好。", ""]
    assert out["src_lang"] == ["en", "en", "en", ""]
    assert out["tgt_lang"] == ["zh", "yue", "wuu", ""]  # unsupported labels kept as given, for the report
    assert out["drop_reason"] == ["", "", "unsupported_language", "unsupported_language"]
    assert out["example_id"] is batch["example_id"]
    assert out["origin"] is batch["origin"]
    assert batch["src"][0] == "  Hello,\tworld. "  # input untouched


def test_clean_batch_takes_numpy_columns():
    batch = {k: np.array(v, dtype=object) for k, v in _batch([("Hi\u00a0there.", "你好。", "en", "zh-TW")]).items()}
    out = clean_batch(batch, CleaningRules())
    assert out == {"src": ["Hi there."], "tgt": ["你好。"], "src_lang": ["en"], "tgt_lang": ["zh-Hant"],
                   "drop_reason": [""]}  # fmt: skip


def test_clean_batch_keeps_earlier_drop_reasons():
    batch = _batch(
        [(None, None, "en", "zh"), ("Hello.", "你好。", "en", "zh"), ("a", "b", "en", "wuu")],
        drop_reason=["malformed", "", "invalid_utf8"],
    )
    out = clean_batch(batch, CleaningRules(on_unsupported_language="error"))  # dropped rows never raise
    assert out["drop_reason"] == ["malformed", "", "invalid_utf8"]


def test_clean_batch_error_mode_names_the_origin():
    batch = _batch([("Hello.", "你好。", "en", "zh"), ("Nei hou.", "Hello.", "yue_Latn", "en")],
                   origin=["corpus.tsv:16", "corpus.tsv:17"])  # fmt: skip
    with pytest.raises(UnsupportedLanguageError) as info:
        clean_batch(batch, CleaningRules(on_unsupported_language="error"))
    assert str(info.value).startswith("corpus.tsv:17: language label 'yue_Latn' is not a Hunyuan-MT language")
    assert "data.on_unsupported_language: drop" in str(info.value)
    with pytest.raises(UnsupportedLanguageError, match=r"^language label 'yue_Latn'"):
        clean_batch({k: v for k, v in batch.items() if k != "origin"}, CleaningRules(on_unsupported_language="error"))


def test_clean_batch_needs_the_pair_columns():
    with pytest.raises(ValueError, match="tgt_lang"):
        clean_batch({"src": [], "tgt": [], "src_lang": []}, CleaningRules())


def test_clean_empty_batch():
    out = clean_batch(_batch([]), CleaningRules())
    assert out == {"src": [], "tgt": [], "src_lang": [], "tgt_lang": [], "drop_reason": []}


def test_mojibake_lines_8940_and_8944(tatoeba_lines):
    """Both have UTF-8 decoded as Latin-1 (with C1 controls) as the Chinese side."""
    out = clean_batch(_tatoeba_batch(tatoeba_lines, [8940, 8944]), CleaningRules())
    # 8940 is labelled cmn_Latn: dropped for its label.
    assert (out["tgt_lang"][0], out["drop_reason"][0]) == ("cmn_Latn", "unsupported_language")
    # 8944 is labelled bare `cmn` (Mandarin): a supported label, and no rule catches mojibake, so it is
    # kept with its C1 controls turned into spaces.
    assert (out["src_lang"][1], out["tgt_lang"][1], out["drop_reason"][1]) == ("en", "zh", "")
    assert out["tgt"][1] == "Nancyå¾ å æ ç å¤§å§ ã"
    assert out["src"][1] == "Nancy looks like my sister."


def test_clean_the_whole_tatoeba_file(tatoeba_lines):
    out = clean_batch(_tatoeba_batch(tatoeba_lines, range(1, len(tatoeba_lines) + 1)), CleaningRules())
    assert Counter(out["drop_reason"]) == {"": 10043, "unsupported_language": 332, "length_ratio": 15}
    kept = Counter(lang for lang, reason in zip(out["tgt_lang"], out["drop_reason"]) if not reason)
    assert kept == {"zh": 4445, "zh-Hant": 4471, "yue": 1127}
    assert set(out["src_lang"]) == {"en"}
    dropped_for_ratio = [n + 1 for n, reason in enumerate(out["drop_reason"]) if reason == "length_ratio"]
    assert dropped_for_ratio[:3] == [23, 148, 3220]  # e.g. line 23: "Address the matters, ..." / "对事不对人。"


# --- keys -----------------------------------------------------------------------------------------


def test_pair_key_is_stable_and_directed():
    key = pair_key("Hello.", "你好。", "en", "zh")
    assert key == "8e0db8e3f830f2128f68567b3e651691"
    assert pair_key("你好。", "Hello.", "zh", "en") != key
    assert pair_key("Hello.", "你好。", "en", "zh-Hant") != key
    assert pair_key("ab", "c", "en", "de") != pair_key("a", "bc", "en", "de")
    assert pair_key("\ud800", "x", "en", "de") != pair_key("", "x", "en", "de")  # lone surrogate: no crash


def test_split_key_is_stable_normalised_and_seeded():
    assert split_key("Hello world.", 0) == 0.1282289280357537  # blake2b, not hash(): same in every process
    assert split_key("Hello world.", 1) == 0.5482810832885467
    assert split_key("  Hello\u00a0world.\u200b", 0) == split_key("Hello world.", 0)
    assert split_key("Hello world!", 0) != split_key("Hello world.", 0)
    assert split_key("x", -3) != split_key("x", 3)


def test_split_key_is_roughly_uniform():
    keys = [split_key(f"sentence number {i}", 7) for i in range(20_000)]
    assert all(0.0 <= k < 1.0 for k in keys)
    bins = Counter(int(k * 10) for k in keys)
    # 2000 expected per bin, standard deviation ~42: 200 is a ~5 sigma band.
    assert sorted(bins) == list(range(10))
    assert all(1800 <= n <= 2200 for n in bins.values()), bins
    assert abs(sum(keys) / len(keys) - 0.5) < 0.01


# --- bad-fraction guard ---------------------------------------------------------------------------


def test_drop_reasons_constant():
    assert DROP_REASONS == (
        "malformed", "invalid_utf8", "other_languages", "unsupported_language", "empty", "too_short", "too_long",
        "length_ratio", "identical", "wrong_language", "duplicate", "too_many_tokens", "subsampled",
    )  # fmt: skip


def test_format_sample():
    assert format_sample("a.tsv:3", "malformed", "only one column") == "a.tsv:3: malformed: 'only one column'"
    assert format_sample("a.tsv:4", "malformed", "x" * 70, width=5) == "a.tsv:4: malformed: 'xxxxx...'"


def test_check_bad_fraction_passes_at_or_below_the_limit():
    check_bad_fraction(1, 100, 0.01, ["a.tsv:1: malformed: 'x'"])
    check_bad_fraction(0, 0, 0.0, [])
    check_bad_fraction(0, 10, 0.0, [])


def test_check_bad_fraction_raises_with_counts_limit_and_five_samples():
    samples = [format_sample(f"a.tsv:{n}", "malformed", f"line {n}") for n in range(1, 8)]
    with pytest.raises(DataQualityError) as info:
        check_bad_fraction(7, 100, 0.05, samples)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "7 of 100 rows are bad (7.00%), above the limit of 5.00% (data.max_bad_fraction)" in message
    assert "a.tsv:1: malformed: 'line 1'" in message
    assert "a.tsv:5: malformed: 'line 5'" in message
    assert "a.tsv:6" not in message


def test_check_bad_fraction_refuses_impossible_counts():
    with pytest.raises(ValueError, match="n_bad"):
        check_bad_fraction(5, 3, 0.5, [])
