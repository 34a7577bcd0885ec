"""The configuration reference, generated from the config models (every field: type, default, docstring).

Regenerate after adding or changing a field::

    python -m raytrain_hymt.config.reference > docs/configuration.md

tests/unit/test_config_docs.py fails while docs/configuration.md differs from this output.
"""

from __future__ import annotations

import re
import sys
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from raytrain_hymt.config.schema import Config

REGENERATE = "python -m raytrain_hymt.config.reference > docs/configuration.md"


def _type_name(annotation) -> str:
    text = repr(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", repr(annotation))
    return re.sub(r"raytrain_hymt\.\w+\.", "", text.replace("typing.", "")).replace("NoneType", "None")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    return f"`{field.default!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section_model(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _table(prefix: str, model: type[BaseModel]) -> list[str]:
    out = [f"## `{prefix}`" if prefix else "## top level", "", _cell(model.__doc__ or ""), "",
           "| field | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        sub = _section_model(field.annotation)
        key = f"{prefix}.{name}" if prefix else name
        if sub is not None:
            many = typing.get_origin(field.annotation) is list
            nested.append((f"{key}[]" if many else key, sub))
            if many or field.description:  # a list of sections, or an optional one: its own row too
                out.append(f"| `{key}` | `{_cell(_type_name(field.annotation))}` | {_cell(_default(field))} | "
                           f"{_cell(field.description or '')} (see below) |")
            continue
        out.append(f"| `{key}` | `{_cell(_type_name(field.annotation))}` | {_cell(_default(field))} | "
                   f"{_cell(field.description or '')} |")
    out.append("")
    for key, sub in nested:
        out += _table(key, sub)
    return out


def render() -> str:
    """docs/configuration.md's text."""
    head = ["# Configuration reference", "",
            f"Generated from `raytrain_hymt/config*.py` by `{REGENERATE}`; do not edit by hand. Presets",
            "(`raytrain_hymt/config/presets/*.yaml`) set some of these fields; `--set SECTION.FIELD=VALUE` overrides any.", ""]
    return "\n".join(head + _table("", Config)).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
