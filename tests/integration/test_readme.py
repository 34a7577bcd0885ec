"""Every README code block marked ``<!-- runnable -->`` runs on CPU and, when a plain ``` block follows it
directly, prints exactly that block: the README cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import REPO

MARKER = "<!-- runnable -->"
# The marker, then a bash block, then optionally (after blank lines) a plain block: its expected output.
BLOCK = re.compile("^" + re.escape(MARKER) + r"\n```bash\n(.*?)```\n(?:\n```\n(.*?)```\n)?", re.S | re.M)


def runnable_blocks() -> list[tuple[str, str | None]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = BLOCK.findall(text)
    markers = len(re.findall("^" + re.escape(MARKER) + "$", text, re.M))
    assert len(blocks) == markers, f"a {MARKER} line is not followed directly by a ```bash block"
    return [(code, expected or None) for code, expected in blocks]


def test_the_readme_has_runnable_blocks():
    assert len(runnable_blocks()) >= 2


@pytest.mark.parametrize("code,expected", runnable_blocks(), ids=lambda v: (v or "")[:40])
def test_readme_block_runs(code, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HYMT_VERBOSE")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    if expected is not None:
        assert out.stdout == expected
