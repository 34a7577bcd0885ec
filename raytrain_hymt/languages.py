"""Hunyuan-MT-7B's languages and the mapping of corpus language labels onto them.

Corpora label languages in many ways: ISO 639-1 (``zh``), ISO 639-2/3 (``zho``, ``cmn``, ``deu``),
BCP-47 tags (``zh-TW``, ``zh-Hant``, ``pt-BR``), Flores-200 codes (``zho_Hant``, ``arb_Arab``) and
Tatoeba's ISO 639-3 + script labels (``cmn_Hans``, ``yue_Hant``, ``wuu``). :func:`resolve` maps all of
them onto the model card's 38 codes, and refuses anything the model was not trained on, including a
script that contradicts the language (romanised Mandarin ``cmn_Latn``, Zhuyin ``cmn_Bopo``): the prompt
would promise the model "Chinese" while the text is in another writing system.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from raytrain_hymt.errors import ConfigError


@dataclass(frozen=True)
class Language:
    """One Hunyuan-MT language: its canonical code and the names its two prompt templates use."""

    code: str
    english_name: str
    chinese_name: str


# The model card's table (code, English name, Chinese name), in its order.
_TABLE = (
    ("zh", "Chinese", "中文"),
    ("en", "English", "英语"),
    ("fr", "French", "法语"),
    ("pt", "Portuguese", "葡萄牙语"),
    ("es", "Spanish", "西班牙语"),
    ("ja", "Japanese", "日语"),
    ("tr", "Turkish", "土耳其语"),
    ("ru", "Russian", "俄语"),
    ("ar", "Arabic", "阿拉伯语"),
    ("ko", "Korean", "韩语"),
    ("th", "Thai", "泰语"),
    ("it", "Italian", "意大利语"),
    ("de", "German", "德语"),
    ("vi", "Vietnamese", "越南语"),
    ("ms", "Malay", "马来语"),
    ("id", "Indonesian", "印尼语"),
    ("tl", "Filipino", "菲律宾语"),
    ("hi", "Hindi", "印地语"),
    ("zh-Hant", "Traditional Chinese", "繁体中文"),
    ("pl", "Polish", "波兰语"),
    ("cs", "Czech", "捷克语"),
    ("nl", "Dutch", "荷兰语"),
    ("km", "Khmer", "高棉语"),
    ("my", "Burmese", "缅甸语"),
    ("fa", "Persian", "波斯语"),
    ("gu", "Gujarati", "古吉拉特语"),
    ("ur", "Urdu", "乌尔都语"),
    ("te", "Telugu", "泰卢固语"),
    ("mr", "Marathi", "马拉地语"),
    ("he", "Hebrew", "希伯来语"),
    ("bn", "Bengali", "孟加拉语"),
    ("ta", "Tamil", "泰米尔语"),
    ("uk", "Ukrainian", "乌克兰语"),
    ("bo", "Tibetan", "藏语"),
    ("kk", "Kazakh", "哈萨克语"),
    ("mn", "Mongolian", "蒙古语"),
    ("ug", "Uyghur", "维吾尔语"),
    ("yue", "Cantonese", "粤语"),
)

LANGUAGES: dict[str, Language] = {code: Language(code, en, zh) for code, en, zh in _TABLE}
"""The 38 Hunyuan-MT languages by canonical code (the model card's abbreviations)."""

# Either side in one of these selects the Chinese prompt template (model card: "ZH<=>XX").
CHINESE_TEMPLATE_CODES = frozenset({"zh", "zh-Hant", "yue"})

# Language subtags (lower case) → canonical base code. ISO 639-1, 639-2/T, 639-2/B (``ger``, ``chi``),
# and the 639-3 individual language a corpus uses for a macrolanguage (Flores: ``arb``, ``pes``, ``zsm``,
# ``khk``; Tatoeba: ``cmn``). Deprecated ``iw``/``in`` are still emitted by Java and old Android locales.
# Other members of a macrolanguage (``wuu``, ``nan``, ``arz``, ``prs``...) are distinct languages the
# model does not claim, so they stay unknown. "zh" here means "Chinese, script still to decide".
_BASE_ALIASES: dict[str, str] = {
    "zh": "zh", "zho": "zh", "chi": "zh", "cmn": "zh",
    "yue": "yue",
    "en": "en", "eng": "en",
    "fr": "fr", "fra": "fr", "fre": "fr",
    "pt": "pt", "por": "pt",
    "es": "es", "spa": "es",
    "ja": "ja", "jpn": "ja",
    "tr": "tr", "tur": "tr",
    "ru": "ru", "rus": "ru",
    "ar": "ar", "ara": "ar", "arb": "ar",
    "ko": "ko", "kor": "ko",
    "th": "th", "tha": "th",
    "it": "it", "ita": "it",
    "de": "de", "deu": "de", "ger": "de",
    "vi": "vi", "vie": "vi",
    "ms": "ms", "msa": "ms", "may": "ms", "zsm": "ms",
    "id": "id", "ind": "id", "in": "id",
    "tl": "tl", "tgl": "tl", "fil": "tl",
    "hi": "hi", "hin": "hi",
    "pl": "pl", "pol": "pl",
    "cs": "cs", "ces": "cs", "cze": "cs",
    "nl": "nl", "nld": "nl", "dut": "nl",
    "km": "km", "khm": "km",
    "my": "my", "mya": "my", "bur": "my",
    "fa": "fa", "fas": "fa", "per": "fa", "pes": "fa",
    "gu": "gu", "guj": "gu",
    "ur": "ur", "urd": "ur",
    "te": "te", "tel": "te",
    "mr": "mr", "mar": "mr",
    "he": "he", "heb": "he", "iw": "he",
    "bn": "bn", "ben": "bn",
    "ta": "ta", "tam": "ta",
    "uk": "uk", "ukr": "uk",
    "bo": "bo", "bod": "bo", "tib": "bo",
    "kk": "kk", "kaz": "kk",
    "mn": "mn", "mon": "mn", "khk": "mn", "mvf": "mn",
    "ug": "ug", "uig": "ug",
}

# Scripts (ISO 15924, lower case) each language is routinely written in; any other script subtag means
# the text is not what the prompt's language name promises (romanised Hindi, Latin-script Japanese...).
# Kazakh, Mongolian and Uyghur are written in several scripts on either side of the Chinese border.
_LATN = frozenset({"latn"})
_SCRIPTS: dict[str, frozenset[str]] = {
    **{code: _LATN for code in ("en", "fr", "pt", "es", "tr", "it", "de", "vi", "id", "tl", "pl", "cs", "nl")},
    "ja": frozenset({"jpan", "hira", "kana", "hrkt", "hani"}),
    "ko": frozenset({"kore", "hang"}),
    "ru": frozenset({"cyrl"}),
    "uk": frozenset({"cyrl"}),
    "ar": frozenset({"arab"}),
    "fa": frozenset({"arab"}),
    "ur": frozenset({"arab"}),
    "ms": frozenset({"latn", "arab"}),
    "th": frozenset({"thai"}),
    "hi": frozenset({"deva"}),
    "mr": frozenset({"deva"}),
    "km": frozenset({"khmr"}),
    "my": frozenset({"mymr"}),
    "gu": frozenset({"gujr"}),
    "te": frozenset({"telu"}),
    "he": frozenset({"hebr"}),
    "bn": frozenset({"beng"}),
    "ta": frozenset({"taml"}),
    "bo": frozenset({"tibt"}),
    "kk": frozenset({"cyrl", "latn", "arab"}),
    "mn": frozenset({"cyrl", "mong"}),
    "ug": frozenset({"arab", "latn", "cyrl"}),
    # Cantonese is written in either Han script; Jyutping (``yue_Latn``) is not.
    "yue": frozenset({"hans", "hant", "hani"}),
}

# Chinese without a script subtag: these regions write Traditional characters (CLDR likely subtags).
_TRADITIONAL_REGIONS = frozenset({"tw", "hk", "mo"})

_SCRIPT = re.compile(r"[a-z]{4}")
_REGION = re.compile(r"[a-z]{2}|[0-9]{3}")
_VARIANT = re.compile(r"[a-z0-9]{5,8}|[0-9][a-z0-9]{3}")
_EXTLANG = re.compile(r"[a-z]{3}")


class UnsupportedLanguageError(ValueError):
    """A language label that names no Hunyuan-MT language (or a script the model does not handle)."""

    def __init__(self, label: str, origin: str | None = None):
        self.label = label
        self.origin = origin
        where = f"{origin}: " if origin else ""
        super().__init__(
            f"{where}language label {label!r} is not a Hunyuan-MT language "
            f"(supported codes: {', '.join(LANGUAGES)}; scripts must match the language, e.g. "
            f"romanised Chinese 'cmn_Latn' is refused). To drop such rows and count them instead of "
            f"failing, set data.on_unsupported_language: drop"
        )

    def __reduce__(self):
        # Ray ships worker exceptions pickled; the default would call __init__(message) and nest it.
        return (type(self), (self.label, self.origin))


def _canonical(subtags: list[str]) -> str | None:
    """Canonical code for lower-cased, split ``language[-extlang][-script][-region][-variant...]``."""
    language, rest = subtags[0], subtags[1:]
    # BCP-47 extlang form (``zh-yue``, ``zh-cmn-Hant``): the extlang is the actual language.
    if language == "zh" and rest and _EXTLANG.fullmatch(rest[0]):
        language, rest = rest[0], rest[1:]
    base = _BASE_ALIASES.get(language)
    if base is None:
        return None
    script = rest.pop(0) if rest and _SCRIPT.fullmatch(rest[0]) else None
    region = rest.pop(0) if rest and _REGION.fullmatch(rest[0]) else None
    if not all(_VARIANT.fullmatch(variant) for variant in rest):
        return None
    if base == "zh":
        if script == "hant" or (script in (None, "hani") and region in _TRADITIONAL_REGIONS):
            return "zh-Hant"
        return "zh" if script in (None, "hans", "hani") else None
    if script is not None and script not in _SCRIPTS[base]:
        return None
    return base


@lru_cache(maxsize=4096)
def _lookup(label: str) -> Language | None:
    """Cached parse of one label, remembering misses too (a corpus repeats a handful of labels)."""
    subtags = label.strip().replace("_", "-").lower().split("-")
    if not all(subtags):
        return None
    code = _canonical(subtags)
    return None if code is None else LANGUAGES[code]


def resolve(label: str) -> Language:
    """The Hunyuan-MT language a corpus label names; :class:`UnsupportedLanguageError` if none.

    Case-insensitive, ``_`` and ``-`` alike. ``cmn_Hans``/``zh-CN`` → ``zh``, ``cmn_Hant``/``zh-TW``/
    ``zh-HK`` → ``zh-Hant``, ``yue_Hans``/``yue_Hant`` → ``yue``, ``eng_Latn``/``en-US`` → ``en``.
    """
    language = _lookup(label) if isinstance(label, str) else None
    if language is None:
        raise UnsupportedLanguageError(label)
    return language


def is_supported(label: str) -> bool:
    """Whether :func:`resolve` accepts ``label``."""
    return isinstance(label, str) and _lookup(label) is not None


def uses_chinese_template(src_code: str, tgt_code: str) -> bool:
    """True when either side is Chinese (``zh``, ``zh-Hant``) or Cantonese: the model card's ZH⇄XX case.

    Takes canonical codes or any label :func:`resolve` accepts.
    """
    return resolve(src_code).code in CHINESE_TEMPLATE_CODES or resolve(tgt_code).code in CHINESE_TEMPLATE_CODES


def parse_direction(text: str) -> tuple[str, str]:
    """``"en-zh"`` → ``("en", "zh")``; codes with a dash of their own work too (``"zh-Hant-en"``).

    Raises ConfigError when no split (or more than one) gives two Hunyuan-MT languages.
    """
    parts = text.split("-")
    splits = [("-".join(parts[:i]), "-".join(parts[i:])) for i in range(1, len(parts))]
    valid = [(resolve(a).code, resolve(b).code) for a, b in splits if is_supported(a) and is_supported(b)]
    if len(valid) != 1:
        why = "is ambiguous" if valid else "does not name two Hunyuan-MT languages"
        raise ConfigError(f"eval.directions: {text!r} {why}; write <source>-<target>, e.g. en-zh or zh-Hant-en")
    return valid[0]


def direction_text(src: str | None, tgt: str | None) -> str:
    """``ja→en`` for messages; ``any`` for a side left open (``ja→any``)."""
    return f"{src or 'any'}→{tgt or 'any'}"


def orientation(src_label: str, tgt_label: str, want_src: str | None, want_tgt: str | None) -> str | None:
    """How a row labelled ``src_label → tgt_label`` gives the direction ``want_src → want_tgt`` (either
    may be None: any language on that side): ``"keep"``, ``"swap"``, or None when it cannot (other
    languages, or a label :func:`resolve` refuses). ``want_*`` must be labels :func:`resolve` accepts."""
    if not (is_supported(src_label) and is_supported(tgt_label)):
        return None
    row = (resolve(src_label).code, resolve(tgt_label).code)
    want = (resolve(want_src).code if want_src else None, resolve(want_tgt).code if want_tgt else None)

    def fits(pair: tuple[str, str]) -> bool:
        return all(w is None or w == code for w, code in zip(want, pair))

    if fits(row):
        return "keep"
    return "swap" if fits(row[::-1]) else None
