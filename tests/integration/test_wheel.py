"""The built wheel, installed where the source tree cannot help: its presets and ``hymt`` work from it.

A checkout passes any package-data mistake silently (an editable install and a cwd inside the repo both
import the source tree), so this builds the wheel from a copy of the sources, installs it with
``--no-deps`` into a fresh venv, takes the other dependencies from this test's venv through
``PYTHONPATH`` (its site-packages only: ``.pth`` files there, the editable install's among them, are not
run for ``PYTHONPATH`` entries), and runs from an empty cwd.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from conftest import REPO
from raytrain_hymt.config.schema import preset_names

#: What the wheel is built from: pyproject.toml names README.md as the readme, so it must be there too.
SOURCES = ("pyproject.toml", "README.md", "raytrain_hymt")

#: Run inside the fresh venv: where the package was imported from, then every shipped preset through
#: ``cli._load`` (what ``hymt train --config NAME`` calls), then a user's own YAML file by path.
PROBE = """
import argparse, json, sys
import raytrain_hymt
from raytrain_hymt import cli
from raytrain_hymt.config.schema import preset_names

def load(config):
    return cli._load(argparse.Namespace(config=config, overrides=[], name=None))

loaded = {name: load(name).preset for name in preset_names()}
mine = load("mine.yaml")
print(json.dumps({"file": raytrain_hymt.__file__, "presets": loaded,
                  "mine": [mine.preset, mine.optim.max_steps]}))
"""


def test_an_installed_wheel_ships_its_presets_and_runs_hymt_outside_the_source_tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(src)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("raytrain_hymt-*.whl")

    # Without pip of its own (ensurepip costs seconds): this venv's pip installs into it through --python.
    fresh = tmp_path / "fresh"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    installed = subprocess.run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr

    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    (cwd / "mine.yaml").write_text("optim:\n  max_steps: 7\n")
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": os.pathsep.join(sorted(deps))}
    assert str(REPO) not in env["PYTHONPATH"].split(os.pathsep)

    probe = subprocess.run([str(python), "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    result = json.loads(probe.stdout.splitlines()[-1])
    imported = Path(result["file"]).resolve()
    assert imported.is_relative_to(fresh.resolve()) and imported.parts[-3:] == ("site-packages", "raytrain_hymt",
                                                                              "__init__.py"), imported
    # Every preset of the source tree, each loaded under its own name, and none more.
    assert preset_names() and "tiny-cpu" in preset_names() and "tune-tiny-cpu" in preset_names()
    assert result["presets"] == {name: name for name in preset_names()}
    assert result["mine"] == ["mine", 7]

    helped = subprocess.run([str(fresh / "bin" / "hymt"), "train", "--help"], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: hymt train") and "--config" in helped.stdout
