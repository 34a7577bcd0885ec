"""Hunyuan-MT-7B's translation prompts (the model card's user turn) and direction expansion.

Pure functions: no Ray, no tokenizer. The chat template wraps the returned text into the user turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from raytrain_hymt.languages import resolve, uses_chinese_template

# Verbatim from the model card: ZH⇄XX (full-width comma and full stop) and XX⇄XX.
CHINESE_TEMPLATE = "把下面的文本翻译成{target_language}，不要额外解释。\n\n{source_text}"
ENGLISH_TEMPLATE = (
    "Translate the following segment into {target_language}, without additional explanation.\n\n{source_text}"
)

# Columns whose values trade places when a pair is reversed.
_SWAPPED = {"src": "tgt", "tgt": "src", "src_lang": "tgt_lang", "tgt_lang": "src_lang"}


def build_prompt(source_text: str, src_code: str, tgt_code: str) -> str:
    """The user-turn text asking Hunyuan-MT to translate ``source_text`` from ``src_code`` to ``tgt_code``.

    The Chinese template (target named in Chinese) when either side is zh, zh-Hant or yue; the English
    one (target named in English) otherwise. Codes may be any label :func:`~raytrain_hymt.languages.resolve`
    accepts.
    """
    target = resolve(tgt_code)
    if uses_chinese_template(src_code, tgt_code):
        return CHINESE_TEMPLATE.format(target_language=target.chinese_name, source_text=source_text)
    return ENGLISH_TEMPLATE.format(target_language=target.english_name, source_text=source_text)


def expand_directions(rows: Mapping[str, Sequence], both_directions: bool) -> dict[str, list]:
    """Add a ``direction`` column (0: as given) and, if ``both_directions``, each pair reversed (1).

    ``rows`` is a batch of columns including ``src``, ``tgt``, ``src_lang``, ``tgt_lang``; other columns
    (``example_id``, ``origin``...) are copied to the reversed rows, so ``(example_id, direction)`` stays
    unique. Reversed rows are appended after the originals.
    """
    if "direction" in rows:
        raise ValueError("rows already have a 'direction' column: expand_directions must run once")
    missing = [name for name in _SWAPPED if name not in rows]
    if missing:
        raise ValueError(f"rows lack column(s) {missing}; expand_directions needs {list(_SWAPPED)}")
    out = {name: list(values) for name, values in rows.items()}
    n = len(out["src"])
    out["direction"] = [0] * n
    if both_directions:
        for name in rows:
            out[name].extend(rows[_SWAPPED.get(name, name)])
        out["direction"].extend([1] * n)
    return out
