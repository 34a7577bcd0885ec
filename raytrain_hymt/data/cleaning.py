"""Row-level cleaning of parallel pairs: text normalisation, language canonicalisation, filters, keys.

Pure functions (no Ray): the pipeline calls :func:`clean_batch` inside ``map_batches`` and filters on the
``drop_reason`` column afterwards, so every dropped row is counted by reason.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from raytrain_hymt.config.schema import DataConfig
from raytrain_hymt.data.language_id import wrong_language
from raytrain_hymt.languages import UnsupportedLanguageError, is_supported, resolve

DROP_REASONS = (
    "malformed",  # reader: a line that is not a pair
    "invalid_utf8",  # reader: bytes that do not decode
    "other_languages",  # reader: a row-labelled pair outside the direction src_lang/tgt_lang select
    "unsupported_language",
    "empty",
    "too_short",
    "too_long",
    "length_ratio",
    "identical",
    "wrong_language",  # a side identified as another language than its label (data.language_id)
    "duplicate",  # exact duplicate of an earlier pair (pair_key)
    "too_many_tokens",  # tokenizer: prompt + answer longer than the example budget
    "subsampled",  # pipeline: left out by a source weight below 1 (not a quality problem)
)
"""Every ``drop_reason`` the data pipeline can give a row, in the order the stages apply them."""

# Invisible characters that carry nothing in running text: zero-width space, word joiner, BOM.
# ZWNJ/ZWJ (U+200C/U+200D) are kept on purpose: they are spelling in Persian, Urdu and the Indic and
# Khmer/Burmese scripts (Persian "می‌خواهم" needs its ZWNJ) and join emoji; deleting them would teach
# the model misspelt targets in languages it supports.
_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u2060\ufeff"))
# C0 controls, DEL, C1 controls and every Unicode whitespace (tab, newline, NBSP, U+3000...) collapse
# to one space: a training pair is one line, and C1 controls only appear in mis-decoded text.
_SPACE_RUN = re.compile(r"[\s\x00-\x1f\x7f-\x9f]+")
# Scripts where one character carries roughly a word (Han, kana, Hangul syllables).
_CJK = re.compile(
    "[\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0003ffff]"
)


def normalize_text(s: str) -> str:
    """NFC; zero-width spaces, word joiners and BOMs removed (ZWNJ/ZWJ kept); controls and whitespace
    runs made one space; stripped."""
    s = s.translate(_ZERO_WIDTH)
    s = _SPACE_RUN.sub(" ", s)
    # NFC last: removing a zero-width character can bring a base letter and its combining mark together.
    return unicodedata.normalize("NFC", s).strip()


_DATA_DEFAULTS = {name: field.default for name, field in DataConfig.model_fields.items()}


@dataclass(frozen=True)
class CleaningRules:
    """Which pairs :func:`clean_batch` marks for dropping. Lengths are in characters after normalisation.

    The fields of the same names are ``data.*`` settings, documented and defaulted once in
    :class:`~raytrain_hymt.config.schema.DataConfig`; the defaults here are read from there.
    """

    min_chars: int = _DATA_DEFAULTS["min_chars"]
    max_chars: int = _DATA_DEFAULTS["max_chars"]
    max_length_ratio: float = _DATA_DEFAULTS["max_length_ratio"]
    ratio_min_chars: int = 10
    """The length ratio applies only when the longer side's weighted length reaches this: short pairs
    ("Go." / "走吧。") vary too much in length to judge."""
    drop_identical: bool = _DATA_DEFAULTS["drop_identical"]
    on_unsupported_language: Literal["drop", "error"] = _DATA_DEFAULTS["on_unsupported_language"]
    language_id: bool = _DATA_DEFAULTS["language_id"]

    def __post_init__(self):
        if self.min_chars < 0 or self.max_chars < max(self.min_chars, 1):
            raise ValueError(f"need 0 <= min_chars <= max_chars, max_chars >= 1; got {self}")
        if self.max_length_ratio < 1 or self.ratio_min_chars < 0:
            raise ValueError(f"need max_length_ratio >= 1 and ratio_min_chars >= 0; got {self}")
        if self.on_unsupported_language not in ("drop", "error"):
            raise ValueError(f"on_unsupported_language must be 'drop' or 'error', not {self.on_unsupported_language!r}")


def _weighted_length(s: str) -> int:
    # A CJK character counts as 2 (for the length ratio only): it carries roughly a word, so one Chinese
    # character is fairer compared with about two Latin ones; raw counts would flag many good
    # English→Chinese pairs. Tatoeba eng-zho has a median of 3.2 English characters per Chinese one, and
    # 15 of its 10,058 supported pairs, all good (terse idioms like "井底之蛙。"), still trip 4.0.
    return len(s) + len(_CJK.findall(s))


def _length_reason(src: str, tgt: str, rules: CleaningRules) -> str:
    """The first length/content rule the normalised pair breaks, or ""."""
    if not src or not tgt:
        return "empty"
    if min(len(src), len(tgt)) < rules.min_chars:
        return "too_short"
    if max(len(src), len(tgt)) > rules.max_chars:
        return "too_long"
    longer, shorter = sorted((_weighted_length(src), _weighted_length(tgt)), reverse=True)
    if longer >= rules.ratio_min_chars and longer > rules.max_length_ratio * shorter:
        return "length_ratio"
    if rules.drop_identical and src.casefold() == tgt.casefold():
        return "identical"
    return ""


def _values(column) -> list:
    # Ray hands numpy arrays (pandas batches: Series); both convert to plain Python objects.
    return column.tolist() if hasattr(column, "tolist") else list(column)


def _text(value) -> str:
    # Missing values arrive as None, or as NaN from pandas batches.
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def clean_batch(batch: Mapping[str, Sequence], rules: CleaningRules) -> dict[str, list]:
    """Normalise a batch of pairs and mark (not remove) the rows to drop.

    Needs columns ``src``, ``tgt``, ``src_lang``, ``tgt_lang``; any others pass through unchanged.
    Returns every row, with texts normalised, supported languages replaced by canonical codes
    (unsupported labels kept as given) and ``drop_reason`` set to "" or the first of
    ``unsupported_language``, ``empty``, ``too_short``, ``too_long``, ``length_ratio``, ``identical``,
    ``wrong_language`` that applies. A row arriving with a non-empty ``drop_reason`` (e.g. ``malformed``) keeps it.
    With ``rules.on_unsupported_language == "error"``, raises :class:`UnsupportedLanguageError`
    naming the row's ``origin`` when the batch has that column.
    """
    missing = [name for name in ("src", "tgt", "src_lang", "tgt_lang") if name not in batch]
    if missing:
        raise ValueError(f"batch lacks column(s) {missing}; has {list(batch)}")
    srcs = [normalize_text(_text(v)) for v in _values(batch["src"])]
    tgts = [normalize_text(_text(v)) for v in _values(batch["tgt"])]
    src_labels = [_text(v) for v in _values(batch["src_lang"])]
    tgt_labels = [_text(v) for v in _values(batch["tgt_lang"])]
    n = len(srcs)
    prior = [_text(v) for v in _values(batch["drop_reason"])] if "drop_reason" in batch else [""] * n
    origins = [_text(v) for v in _values(batch["origin"])] if "origin" in batch else None

    src_langs, tgt_langs, reasons = [], [], []
    for i in range(n):
        reason = prior[i]
        codes = []
        for label in (src_labels[i], tgt_labels[i]):
            if is_supported(label):
                codes.append(resolve(label).code)
                continue
            codes.append(label)
            if not reason:
                if rules.on_unsupported_language == "error":
                    raise UnsupportedLanguageError(label, origins[i] if origins else None)
                reason = "unsupported_language"
        src_langs.append(codes[0])
        tgt_langs.append(codes[1])
        reason = reason or _length_reason(srcs[i], tgts[i], rules)
        if not reason and rules.language_id and wrong_language(srcs[i], tgts[i], codes[0], codes[1]):
            reason = "wrong_language"
        reasons.append(reason)

    out = dict(batch)
    out.update(src=srcs, tgt=tgts, src_lang=src_langs, tgt_lang=tgt_langs, drop_reason=reasons)
    return out


def _encode(s: str) -> bytes:
    # surrogatepass: a lone surrogate (from a lenient decode) must still hash, never crash a batch.
    return s.encode("utf-8", "surrogatepass")


def pair_key(src: str, tgt: str, src_lang: str, tgt_lang: str) -> str:
    """Stable 32-hex-digit key of a directed pair, for exact-duplicate removal (pass normalised text)."""
    h = hashlib.blake2b(digest_size=16)
    for field in (src_lang, tgt_lang, src, tgt):
        data = _encode(field)
        # Length-prefixed, so ("ab", "c") and ("a", "bc") cannot collide.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def split_key(src: str, seed: int) -> float:
    """Deterministic position in [0, 1) of a source sentence, for the train/validation split.

    blake2b of the seed and the normalised source: the same on every machine, process and Python run
    (unlike ``hash``), and alternative translations of one sentence land on the same side.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(seed.to_bytes(16, "little", signed=True))
    h.update(_encode(normalize_text(src)))
    # Top 53 bits: a float holds them exactly, so the result can never round up to 1.0.
    return (int.from_bytes(h.digest(), "big") >> 11) / (1 << 53)


class DataQualityError(ValueError):
    """Too large a share of the input is unusable: likely the wrong file, format or encoding."""


def format_sample(origin: str, reason: str, text: str, width: int = 60) -> str:
    """One bad-row example for :func:`check_bad_fraction`: ``file:line: reason: 'text...'``."""
    shown = text if len(text) <= width else text[:width] + "..."
    return f"{origin}: {reason}: {shown!r}"


def check_bad_fraction(n_bad: int, n_total: int, max_fraction: float, samples: list[str]) -> None:
    """Raise :class:`DataQualityError` when ``n_bad / n_total`` exceeds ``max_fraction``.

    ``samples`` are examples of bad rows (see :func:`format_sample`); the message shows up to 5.
    """
    if not 0 <= n_bad <= n_total:
        raise ValueError(f"need 0 <= n_bad <= n_total, got n_bad={n_bad}, n_total={n_total}")
    if n_total == 0 or n_bad / n_total <= max_fraction:
        return
    examples = "".join(f"\n  {sample}" for sample in samples[:5])
    raise DataQualityError(
        f"{n_bad} of {n_total} rows are bad ({n_bad / n_total:.2%}), above the limit of {max_fraction:.2%} "
        f"(data.max_bad_fraction). Check the file format and encoding, or raise the limit. "
        f"Examples:{examples or ' none recorded'}"
    )
