"""README.md is a user's page: short, and free of a lab notebook's clock times, commit hashes and pointers
to files outside the repository (measurements live in benchmarks/results/)."""

from __future__ import annotations

import re

from conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_the_readme_is_at_most_250_lines_and_starts_with_what_it_is_and_the_two_commands():
    assert len(README.splitlines()) <= 250
    assert README.startswith("# raytrain_hymt\n\nFine-tune ")
    quick = README[README.index("## Quick start"):]
    assert quick.index("make train") < quick.index("make test") < quick.index("\n## ")


def test_the_readme_has_no_clock_time_commit_hash_or_outside_file():
    assert re.findall(r"\b\d{1,2}:\d{2} UTC\b", README) == []
    assert re.findall(r"`[0-9a-f]{7,40}`", README) == []
    assert [w for w in ("FACTS.md", "../shared", "tutorial") if w in README] == []
