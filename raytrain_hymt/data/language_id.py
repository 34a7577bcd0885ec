"""Which language a segment is written in, to catch pairs whose texts are not in the languages their labels say.

py3langid (BSD-3-Clause; its naive Bayes model over byte n-grams ships inside the wheel, nothing is
downloaded) identifies each side. Its candidates are restricted to Hunyuan-MT's languages it knows, plus
its ``zxx`` "not a language" class (numbers, markup), which never counts as a wrong language. Languages it
cannot tell apart are one group: Chinese in either script and Cantonese (it has no script classes, and
Tatoeba's Cantonese rows are often written like Mandarin), and Malay with Indonesian. A pair is checked
only when both its languages are known and in different groups; a side shorter than :data:`MIN_BYTES`
or identified with less than :data:`MIN_CONFIDENCE` stays unchecked.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

from raytrain_hymt.languages import LANGUAGES

MIN_BYTES = 15
"""Shortest side (UTF-8 bytes, what the model reads: 15 Latin letters, 5 Chinese or Devanagari characters)
that is identified. On Tatoeba eng-zho and deu-eng, the identifier's confident mistakes are short
sentences ("Be fair.", "Bon voyage!")."""
MIN_CONFIDENCE = 0.9
"""Probability (summed over a group) needed to call a side another language. On 33,500 correct segments
(Tatoeba eng-zho and deu-eng, FLORES devtest en, de, ja, zh) no wrong language scored above 0.70, and
91-100% of each set's own language scored at least 0.9."""

UNCHECKED: dict[str, str] = {"bo": "py3langid's model has no Tibetan"}
"""Hunyuan-MT languages whose pairs are never checked, and why."""
GROUPS: dict[str, str] = {"zh-Hant": "zh", "yue": "zh", "id": "ms"}
"""Hunyuan-MT codes identified together with another (the group's code): not told apart from each other."""

_NOT_LANGUAGE = "zxx"
_SHARED = frozenset(GROUPS.values())


def group(code: str) -> str:
    """The group a canonical Hunyuan-MT code is identified as (``yue`` → ``zh``, ``id`` → ``ms``)."""
    return GROUPS.get(code, code)


def checks(src_code: str, tgt_code: str) -> bool:
    """Whether pairs of these canonical codes are checked: both known to the model, in different groups."""
    return src_code not in UNCHECKED and tgt_code not in UNCHECKED and group(src_code) != group(tgt_code)


@lru_cache(maxsize=1)
def _identifier():
    # Once per process (each Ray Data worker loads it at its first batch, about a second): the model is
    # 4.5 MB compressed, far too slow to load per batch.
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    # py3langid's codes are Hunyuan-MT's but for Traditional Chinese (no script classes: its "zh" is both).
    labels = {"zh" if code == "zh-Hant" else code for code in LANGUAGES if code not in UNCHECKED}
    identifier.set_languages(sorted(labels | {_NOT_LANGUAGE}))
    return identifier


def identify(text: str, expected: str | None = None) -> str | None:
    """The group code (:func:`group`) ``text`` is written in, or None when it cannot be said: shorter than
    :data:`MIN_BYTES`, below :data:`MIN_CONFIDENCE`, or no language (numbers, markup).

    With ``expected`` (a group code), that group as soon as it is the most likely one, however unsure:
    then no other language can reach the confidence, and the slower summing is skipped."""
    if len(text.encode("utf-8", "surrogatepass")) < MIN_BYTES:
        return None
    identifier = _identifier()
    best, confidence = identifier.classify(text)
    best = group(best)
    if best == expected:
        return best
    if confidence < MIN_CONFIDENCE and best in _SHARED:
        # A group's probability can be split between its members (Traditional Chinese between zh and
        # yue); the full ranking (slower, so only here) sums them.
        summed: Counter[str] = Counter()
        for label, p in identifier.rank(text):
            summed[group(label)] += p
        best, confidence = summed.most_common(1)[0]
    return None if confidence < MIN_CONFIDENCE or best == _NOT_LANGUAGE else best


def wrong_language(src: str, tgt: str, src_code: str, tgt_code: str) -> bool:
    """Whether a pair of canonical codes has a side identified as another language than its label."""
    if not checks(src_code, tgt_code):
        return False
    return any(identify(text, group(code)) not in (None, group(code)) for text, code in ((src, src_code), (tgt, tgt_code)))


#: Identified pairs a file's sample needs before it is judged (fewer say nothing about the file).
MIN_IDENTIFIED = 10


def sample_problem(pairs: list[tuple[str, str]], src_code: str, tgt_code: str) -> str | None:
    """Why the first ``pairs`` of a file (canonical codes given) look swapped, or a side looks to be in a
    third language, as the end of one sentence after the file's name; None when they look right or
    cannot be judged."""
    if not checks(src_code, tgt_code):
        return None
    found = [(identify(s), identify(t)) for s, t in pairs]
    both = [(s, t) for s, t in found if s is not None and t is not None]
    swapped = sum(1 for s, t in both if (s, t) == (group(tgt_code), group(src_code)))
    if len(both) >= MIN_IDENTIFIED and 2 * swapped > len(both):
        return (f"looks swapped: {swapped} of its first {len(both)} identifiable lines have {tgt_code} text in the "
                f"src column and {src_code} in the tgt column, but src_lang is {src_code} and tgt_lang is "
                f"{tgt_code}; swap src_lang/tgt_lang (or the columns)")
    for side, code in (("tgt", tgt_code), ("src", src_code)):
        seen = [pair[side == "tgt"] for pair in found if pair[side == "tgt"] is not None]
        if len(seen) < MIN_IDENTIFIED:
            continue
        third, n = Counter(seen).most_common(1)[0]
        if third != group(code) and 2 * n > len(seen):
            return (f"has {third} text in its {side} column: {n} of its first {len(seen)} identifiable {side} lines "
                    f"are {third}, but {side}_lang is {code}; set {side}_lang to the column's language (or fix "
                    f"the file)")
    return None
