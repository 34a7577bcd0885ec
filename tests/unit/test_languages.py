import pickle
from collections import Counter

import pytest

from raytrain_hymt.languages import (
    LANGUAGES,
    Language,
    UnsupportedLanguageError,
    is_supported,
    orientation,
    resolve,
    uses_chinese_template,
)
from raytrain_hymt.data.files import SAMPLE_CORPUS


def test_the_model_cards_38_languages():
    assert len(LANGUAGES) == 38
    assert list(LANGUAGES) == [
        "zh", "en", "fr", "pt", "es", "ja", "tr", "ru", "ar", "ko", "th", "it", "de", "vi", "ms", "id", "tl",
        "hi", "zh-Hant", "pl", "cs", "nl", "km", "my", "fa", "gu", "ur", "te", "mr", "he", "bn", "ta", "uk",
        "bo", "kk", "mn", "ug", "yue",
    ]  # fmt: skip
    assert LANGUAGES["zh-Hant"] == Language("zh-Hant", "Traditional Chinese", "繁体中文")
    assert LANGUAGES["yue"] == Language("yue", "Cantonese", "粤语")
    assert LANGUAGES["tl"] == Language("tl", "Filipino", "菲律宾语")
    assert LANGUAGES["id"] == Language("id", "Indonesian", "印尼语")
    assert all(code == lang.code for code, lang in LANGUAGES.items())


def test_language_is_frozen():
    with pytest.raises(AttributeError):
        LANGUAGES["en"].code = "eng"


@pytest.mark.parametrize("code", list(LANGUAGES))
def test_canonical_codes_resolve_to_themselves(code):
    assert resolve(code) is LANGUAGES[code]
    assert resolve(code.upper()) is LANGUAGES[code]


@pytest.mark.parametrize(
    "label, code",
    [
        # ISO 639-1 / 639-2 / 639-3, any case, surrounding spaces
        ("zh", "zh"), ("ZH", "zh"), (" en ", "en"), ("zho", "zh"), ("chi", "zh"), ("cmn", "zh"),
        ("eng", "en"), ("deu", "de"), ("ger", "de"), ("fra", "fr"), ("fre", "fr"), ("yue", "yue"),
        ("fil", "tl"), ("iw", "he"), ("in", "id"), ("per", "fa"), ("may", "ms"),
        # BCP-47: script wins over region; Traditional regions without a script
        ("zh-CN", "zh"), ("zh_cn", "zh"), ("zh-Hans", "zh"), ("zh-SG", "zh"), ("zh-Hani", "zh"),
        ("zh-TW", "zh-Hant"), ("zh-HK", "zh-Hant"), ("zh-MO", "zh-Hant"), ("zh-Hant", "zh-Hant"),
        ("ZH-hANT", "zh-Hant"), ("zh_Hant_TW", "zh-Hant"), ("zh-Hant-CN", "zh-Hant"), ("zh-Hans-HK", "zh"),
        ("en-US", "en"), ("en_GB", "en"), ("pt-BR", "pt"), ("es-419", "es"), ("de-DE-1996", "de"),
        ("zh-yue", "yue"), ("zh-cmn-Hant", "zh-Hant"), ("yue-HK", "yue"), ("sr-Latn", None),
        # Flores-200
        ("zho_Hans", "zh"), ("zho_Hant", "zh-Hant"), ("eng_Latn", "en"), ("deu_Latn", "de"),
        ("jpn_Jpan", "ja"), ("yue_Hant", "yue"), ("kor_Hang", "ko"), ("arb_Arab", "ar"), ("pes_Arab", "fa"),
        ("zsm_Latn", "ms"), ("tgl_Latn", "tl"), ("khk_Cyrl", "mn"), ("bod_Tibt", "bo"), ("uig_Arab", "ug"),
        ("kaz_Cyrl", "kk"), ("mya_Mymr", "my"), ("khm_Khmr", "km"), ("hin_Deva", "hi"), ("heb_Hebr", "he"),
        # Tatoeba
        ("cmn_Hans", "zh"), ("cmn_Hant", "zh-Hant"), ("yue_Hans", "yue"), ("yue_Hant", "yue"),
    ],
)  # fmt: skip
def test_resolve(label, code):
    if code is None:
        assert not is_supported(label)
    else:
        assert resolve(label).code == code
        assert is_supported(label)


@pytest.mark.parametrize(
    "label",
    [
        # Chinese languages Hunyuan-MT does not claim (Tatoeba labels)
        "wuu", "wuu_Hani", "lzh", "lzh_Hani", "lzh_Hans", "cjy_Hans", "cjy_Hant", "nan_Hani", "nan_Latn",
        "gan", "hak",
        # a script contradicting the language: romanised / phonetic Chinese, romaji, Latin-script Hindi
        "cmn_Latn", "cmn_Bopo", "yue_Latn", "zh-Latn", "zho_Latn", "ja-Latn", "hi-Latn", "en-Cyrl",
        "eng_Arab", "ru-Latn",
        # malformed or unknown
        "", " ", "-", "zh-", "-zh", "zh--CN", "zh-Hans-Hant", "xx", "klingon", "en-US-x", "Chinese",
        "arz", "prs",
    ],
)  # fmt: skip
def test_unsupported_labels_raise(label):
    assert not is_supported(label)
    with pytest.raises(UnsupportedLanguageError) as info:
        resolve(label)
    assert isinstance(info.value, ValueError)
    assert info.value.label == label


def test_non_string_label_is_unsupported():
    assert not is_supported(None)
    with pytest.raises(UnsupportedLanguageError, match="None"):
        resolve(None)


def test_unsupported_error_message_and_pickling():
    err = UnsupportedLanguageError("cmn_Latn", "corpus.tsv:17")
    message = str(err)
    assert message.startswith("corpus.tsv:17: language label 'cmn_Latn' is not a Hunyuan-MT language")
    assert "data.on_unsupported_language: drop" in message
    assert "zh-Hant" in message  # lists what is supported
    # Ray ships exceptions from workers pickled: the message must not get nested.
    clone = pickle.loads(pickle.dumps(err))
    assert (str(clone), clone.label, clone.origin) == (message, "cmn_Latn", "corpus.tsv:17")
    assert "corpus.tsv" not in str(UnsupportedLanguageError("wuu"))


@pytest.mark.parametrize(
    "src, tgt, expected",
    [
        ("en", "zh", True), ("zh", "en", True), ("en", "zh-Hant", True), ("yue", "en", True),
        ("zh", "yue", True), ("de", "en", False), ("ja", "ko", False), ("eng_Latn", "cmn_Hant", True),
        ("fr-CA", "pt-BR", False),
    ],
)  # fmt: skip
def test_uses_chinese_template(src, tgt, expected):
    assert uses_chinese_template(src, tgt) is expected


def test_uses_chinese_template_refuses_unsupported():
    with pytest.raises(UnsupportedLanguageError):
        uses_chinese_template("en", "wuu")


def test_tatoeba_eng_zho_label_partition():
    """Every label of the real Tatoeba eng-zho test set (the bundled sample) lands exactly where it should."""
    with SAMPLE_CORPUS.open(encoding="utf-8") as f:
        columns = [line.split("\t")[:2] for line in f]
    assert {resolve(src).code for src, _ in columns} == {"en"}
    labels = Counter(tgt for _, tgt in columns)
    assert sum(labels.values()) == 10390
    supported = {label: resolve(label).code for label in labels if is_supported(label)}
    assert supported == {
        "cmn_Hans": "zh", "cmn_Hant": "zh-Hant", "cmn": "zh", "yue_Hans": "yue", "yue_Hant": "yue",
    }  # fmt: skip
    per_code = Counter()
    for label, code in supported.items():
        per_code[code] += labels[label]
    # cmn_Hans 4450 + the one bare `cmn` line; cmn_Hant 4476; yue_Hans 677 + yue_Hant 454.
    assert per_code == {"zh": 4451, "zh-Hant": 4476, "yue": 1131}
    assert sum(per_code.values()) == 10058
    unsupported = {label: n for label, n in labels.items() if label not in supported}
    assert unsupported == {
        "cjy_Hans": 2, "cjy_Hant": 1, "cmn_Bopo": 3, "cmn_Latn": 11, "gan": 1, "lzh": 2, "lzh_Bopo": 8,
        "lzh_Hang": 15, "lzh_Hani": 54, "lzh_Hans": 3, "lzh_Hira": 10, "lzh_Kana": 7, "lzh_Yiii": 4,
        "nan_Hani": 1, "nan_Latn": 1, "wuu": 196, "wuu_Bopo": 1, "wuu_Hang": 2, "wuu_Hani": 8, "wuu_Hira": 1,
        "yue_Latn": 1,
    }  # fmt: skip
    assert sum(unsupported.values()) == 332


@pytest.mark.parametrize("row, want, expected", [
    (("eng", "jpn"), ("en", "ja"), "keep"),
    (("eng", "jpn"), ("ja", "en"), "swap"),
    (("eng", "jpn"), ("ja", None), "swap"),
    (("eng", "jpn"), (None, "jpn"), "keep"),
    (("eng", "deu"), ("ja", "en"), None),
    (("wuu", "eng"), ("zh", "en"), None),  # an unsupported label never fits
    (("cmn_Hant", "eng"), ("zh-TW", "en"), "keep"),  # compared as canonical codes
])
def test_orientation_of_a_labelled_row(row, want, expected):
    assert orientation(*row, *want) == expected


def test_every_suggestion_for_a_mistyped_label_is_a_hunyuan_language():
    # "did you mean" names the suggestion's language: one outside the table crashed preflight (dk → da).
    from raytrain_hymt.data.preflight import _NOT_SUPPORTED, _SUGGEST, nearest_language

    assert set(_SUGGEST.values()) <= set(LANGUAGES)
    assert not set(_NOT_SUPPORTED) & set(_SUGGEST)
    assert nearest_language("dk") is None and nearest_language("dkk") in LANGUAGES
