"""docs/configuration.md is the generated reference of every config field, never stale."""

from __future__ import annotations

from conftest import REPO

from raytrain_hymt.config.schema import Config
from raytrain_hymt.config.reference import REGENERATE, render


def test_configuration_reference_is_current():
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert text == render(), f"docs/configuration.md is stale; regenerate it with: {REGENERATE}"


def test_every_field_of_every_section_has_a_row_with_its_docstring():
    text = render()
    for section, field in Config.model_fields.items():
        model = field.annotation if isinstance(field.annotation, type) else None
        if model is None or not hasattr(model, "model_fields"):
            continue
        for name, sub in model.model_fields.items():
            row = next(line for line in text.splitlines() if line.startswith(f"| `{section}.{name}` |"))
            assert sub.description and " ".join(sub.description.split())[:40] in row
    assert "| `optim.lr` | `float` |" in text and "| `eval.directions` | `list[str] \\| None` | `None` |" in text
