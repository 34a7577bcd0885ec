"""A corpus or an input file in another encoding than the one configured, met as a user meets it: ``hymt`` in
a subprocess with its own HOME and TMPDIR and no RAY_ADDRESS (a Ray session folder would appear there),
stopped before Ray by one line naming the file and the encoding it reads as; and ``hymt translate
--encoding`` translating such a file (in this process, with the tiny model, as tests/integration/
test_translate.py calls it). The texts are FLORES-200 devtest lines (tests/assets/flores200)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from raytrain_hymt.cli import main

FLORES = REPO / "tests" / "assets" / "flores200" / "devtest"


def _aligned(n: int = 20) -> tuple[list[str], list[str]]:
    """``n`` aligned English/Japanese lines whose English is ASCII and whose Japanese Shift-JIS can write."""
    en = (FLORES / "eng_Latn.devtest").read_text(encoding="utf-8").split("\n")
    ja = (FLORES / "jpn_Jpan.devtest").read_text(encoding="utf-8").split("\n")
    pairs = []
    for e, j in zip(en, ja):
        try:
            j.encode("shift_jis")
        except UnicodeEncodeError:
            continue
        if e.isascii():
            pairs.append((e, j))
    return [e for e, _ in pairs[:n]], [j for _, j in pairs[:n]]


def _sjis_moses(folder: Path) -> Path:
    """A 20-line Moses pair ``sjis.en`` (ASCII) / ``sjis.ja`` (Shift-JIS); returns the prefix."""
    en, ja = _aligned()
    (folder / "sjis.en").write_bytes("".join(f"{line}\n" for line in en).encode("ascii"))
    (folder / "sjis.ja").write_bytes("".join(f"{line}\n" for line in ja).encode("shift_jis"))
    return folder / "sjis"


def _hymt(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``hymt ARGV`` as a user runs it, with HOME/TMPDIR in tmp_path/home (returned) and no RAY_ADDRESS."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(HOME=str(home), TMPDIR=str(home), RAY_TMPDIR=str(home),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "raytrain_hymt.cli", *argv], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    return run, home


def _moses_source(prefix: Path, **extra) -> str:
    return "data.sources=" + json.dumps([{"path": str(prefix), "format": "moses", "src_lang": "en", "tgt_lang": "ja",
                                          **extra}])


def test_a_shift_jis_moses_pair_stops_before_ray_naming_the_ja_file(tmp_path):
    prefix = _sjis_moses(tmp_path)
    runs = tmp_path / "runs"
    run, home = _hymt(tmp_path, "train", "--name", "enc", "--set", _moses_source(prefix),
                      "--set", f"run.storage_root={runs}")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr == (f"error: data.sources[0].encoding: {tmp_path}/sjis.ja line 1 is not valid utf-8 (byte 0x81 "
                          "at column 1); it reads as shift_jis: set encoding: shift_jis\n")
    assert not list(home.rglob("session_*")), list(home.rglob("*"))
    assert not runs.exists()  # no run folder, no mlflow.db


def test_the_same_pair_with_its_encoding_passes_preflight(tmp_path):
    """Stopped by the one other mistake preflight finds (a model folder that does not exist): had the
    Shift-JIS pair been refused too, its line would come first."""
    prefix = _sjis_moses(tmp_path)
    runs = tmp_path / "runs"
    run, home = _hymt(tmp_path, "train", "--name", "enc", "--set", _moses_source(prefix, encoding="shift_jis"),
                      "--set", "model.name_or_path=/nope", "--set", f"run.storage_root={runs}")
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr == ("error: model.name_or_path: no such folder '/nope' (looked for a local model folder; a hub "
                          "id is written org/name, e.g. tencent/Hunyuan-MT-7B)\n")
    assert not list(home.rglob("session_*")) and not runs.exists()


def test_translate_names_the_input_file_and_translates_it_with_its_encoding(tmp_path, capsys):
    _, ja = _aligned(3)
    path = tmp_path / "sjis.txt"
    path.write_bytes("".join(f"{line}\n" for line in ja).encode("shift_jis"))
    run, _ = _hymt(tmp_path, "translate", "-m", "tiny", "--from", "ja", "--to", "en", "-i", str(path))
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == (f"error: --input {path} line 1 is not valid utf-8 (byte 0x81 at column 1); it reads as "
                          "shift_jis: add --encoding shift_jis\n")

    short = ["translate", "--set", "eval.max_new_tokens=8", "-m", "tiny", "--from", "ja", "--to", "en"]
    assert main([*short, *ja]) == 0
    expected = capsys.readouterr().out
    assert main([*short, "-i", str(path), "--encoding", "shift_jis"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected and len(expected.splitlines()) == 3 and captured.err == ""
