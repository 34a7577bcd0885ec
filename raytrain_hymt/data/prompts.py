"""Translation prompts of Tencent's translation model families (their model cards' user turns) and
direction expansion.

Each family's templates are pinned copies of its model card, kept whitespace-exact as package data in
``raytrain_hymt/data/templates/<family>.json`` (source URL and revision at the top of each file). A row
picks its prompt kind through optional fields: ``terms`` (source→target term pairs), ``context``
(preceding or background text), ``style`` and ``formatted``; without them it gets the plain prompt.

Pure functions: no Ray, no tokenizer. The chat template wraps the returned text into the user turn.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from importlib import resources
from pathlib import Path

from raytrain_hymt.languages import resolve, uses_chinese_template

log = logging.getLogger(__name__)

FAMILIES = ("hunyuan-mt", "hy-mt1.5", "hy-mt2")
DEFAULT_FAMILY = "hunyuan-mt"
#: The per-example fields that choose a prompt kind (``plain`` when none is set).
KIND_FIELDS = ("terms", "context", "style", "formatted")


@lru_cache(maxsize=None)
def family_templates(family: str) -> dict:
    """The pinned template file of ``family`` (see :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"model.family: unknown family {family!r}; choose one of {', '.join(FAMILIES)} or auto")
    text = resources.files("raytrain_hymt.data").joinpath("templates", f"{family}.json").read_text("utf-8")
    return json.loads(text)


def prompt_kinds(family: str) -> tuple[str, ...]:
    """The prompt kinds ``family``'s model card defines (``plain`` first)."""
    return tuple(family_templates(family)["kinds"])


# Verbatim from Hunyuan-MT-7B's model card: ZH⇄XX (full-width comma and full stop) and XX⇄XX.
CHINESE_TEMPLATE = family_templates(DEFAULT_FAMILY)["kinds"]["plain"]["zh"]
ENGLISH_TEMPLATE = family_templates(DEFAULT_FAMILY)["kinds"]["plain"]["en"]

# Columns whose values trade places when a pair is reversed.
_SWAPPED = {"src": "tgt", "tgt": "src", "src_lang": "tgt_lang", "tgt_lang": "src_lang"}

# Hy-MT2's card names the placeholders differently from HY-MT1.5's: both spellings are filled.
_ALIASES = {"target_language": "target_lang", "source_text": "src_text_with_format", "context": "background_text",
            "style": "target_style"}


def _is_set(value) -> bool:
    """Whether a row's optional field carries something (Parquet and NumPy give None, NaN or empty)."""
    if value is None or value is False:
        return False
    if isinstance(value, float):
        return not math.isnan(value)
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, Sequence) or hasattr(value, "__len__"):
        return len(value) > 0
    return bool(value)


def term_pairs(terms) -> list[tuple[str, str]]:
    """``terms`` as (source, target) pairs: each item a 2-item list or a mapping with ``source`` and
    ``target``."""
    pairs = []
    for item in terms:
        if isinstance(item, Mapping):
            pair = (item.get("source"), item.get("target"))
        else:
            pair = tuple(item) if not isinstance(item, str) else (item,)
        if len(pair) != 2 or not all(isinstance(t, str) and t for t in pair):
            raise ValueError(f"terms: each term must be [source, target] or {{source, target}}, got {item!r}")
        pairs.append(pair)
    return pairs


def prompt_kind(family: str, fields: Mapping) -> str:
    """The kind of prompt a row's optional :data:`KIND_FIELDS` ask for, ``plain`` when none is set."""
    chosen = [name for name in KIND_FIELDS if _is_set(fields.get(name))]
    if len(chosen) > 1:
        raise ValueError(f"a row may set only one of {', '.join(KIND_FIELDS)}; this one sets {', '.join(chosen)}")
    kind = chosen[0] if chosen else "plain"
    if kind not in family_templates(family)["kinds"]:
        raise ValueError(
            f"{kind}: model family {family} has no such prompt (its kinds: {', '.join(prompt_kinds(family))})"
        )
    return kind


def build_prompt(source_text: str, src_code: str, tgt_code: str, family: str = DEFAULT_FAMILY,
                 **fields) -> str:
    """The user-turn text asking a model of ``family`` to translate ``source_text`` from ``src_code`` to
    ``tgt_code``.

    ``fields`` are a row's optional :data:`KIND_FIELDS`: ``terms`` (a list of source→target pairs),
    ``context`` (text the source follows), ``style`` or ``formatted`` (true: ``source_text`` carries
    ``<sn></sn>`` format tags); none set gives the plain prompt. The Chinese template (target named in
    Chinese) when either side is zh, zh-Hant or yue, the English one (target named in English) otherwise;
    a kind the card gives only in Chinese is Chinese for every pair. Codes may be any label
    :func:`~raytrain_hymt.languages.resolve` accepts.
    """
    templates = family_templates(family)
    kind = prompt_kind(family, fields)
    versions = templates["kinds"][kind]
    target = resolve(tgt_code)
    lang = "zh" if "en" not in versions or uses_chinese_template(src_code, tgt_code) else "en"
    if kind == "formatted" and target.code != "zh":
        raise ValueError(f"formatted: {family}'s formatted prompt translates into Chinese only, not {tgt_code!r}")
    values = {
        "target_language": target.chinese_name if lang == "zh" else target.english_name,
        "source_text": source_text,
        "context": str(fields.get("context") or ""),
        "style": str(fields.get("style") or ""),
        "terms": "",
    }
    if kind == "terms":
        line = templates["term_line"][lang]
        values["terms"] = "\n".join(line.format(source_term=s, target_term=t) for s, t in term_pairs(fields["terms"]))
    values.update({alias: values[name] for name, alias in _ALIASES.items()})
    return versions[lang].format(**values)


def detect_family(name_or_path: str) -> str | None:
    """The family a model's name or folder shows, None when nothing does.

    A family's name in the path (``Hy-MT2-7B``, ``HY-MT1.5-1.8B``, ``Hunyuan-MT-7B``), else, for a local
    folder, Hy-MT2's chat-template turn marker ``<｜hy_User｜>`` in ``tokenizer_config.json`` or
    ``chat_template.jinja``. HY-MT1.5 and Hunyuan-MT share their architecture and chat template, so an
    unnamed folder of either is not told apart.
    """
    name = name_or_path.lower().replace("_", "-")
    for family, marks in (("hy-mt2", ("hy-mt2",)), ("hy-mt1.5", ("hy-mt1.5", "hy-mt1-5")),
                          ("hunyuan-mt", ("hunyuan-mt",))):
        if any(m in name for m in marks):
            return family
    folder = Path(name_or_path)
    for file in ("chat_template.jinja", "tokenizer_config.json"):
        try:
            text = (folder / file).read_text(encoding="utf-8")
        except OSError:
            continue
        if file.endswith(".json"):
            try:  # JSON may escape the marker's full-width bars (\uff5c)
                text = json.dumps(json.loads(text), ensure_ascii=False)
            except ValueError:
                continue
        if "<｜hy_User｜>" in text:
            return "hy-mt2"
    return None


def resolve_family(family: str, name_or_path: str) -> str:
    """``model.family`` made concrete: itself unless ``auto``, then :func:`detect_family` or
    :data:`DEFAULT_FAMILY` (said in one info line)."""
    if family != "auto":
        family_templates(family)
        return family
    found = detect_family(name_or_path)
    if found is None:
        log.info("model.family: nothing in %s names a model family; using %s's prompts (set model.family "
                 "to choose)", name_or_path, DEFAULT_FAMILY)
        return DEFAULT_FAMILY
    return found


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
        if "terms" in rows:
            # A reversed pair's terms go the other way too.
            out["terms"][n:] = [[[t, s] for s, t in term_pairs(v)] if _is_set(v) else v for v in rows["terms"]]
        out["direction"].extend([1] * n)
    return out
