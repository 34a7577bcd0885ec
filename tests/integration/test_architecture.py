"""The house's rules (docs/architecture.md): layers and no import circle (import-linter, which sees imports
inside functions too), no heavy framework imported at module level by a pure module, every module in a
layer, and no module over 400 lines."""

from __future__ import annotations

import ast
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import raytrain_hymt
from conftest import REPO

PACKAGE = REPO / "raytrain_hymt"
HEAVY = {"ray", "torch", "deepspeed", "mlflow"}
MAX_LINES = 400
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def layers() -> list[list[str]]:
    """The contract's layers, top first, as lists of module names (optional ones without parentheses)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    return [[f"raytrain_hymt.{m.strip().strip('()')}" for m in layer.split(":")] for layer in config["layers"]]


def modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(raytrain_hymt.__path__, "raytrain_hymt.") if not m.ispkg)


def lint(cwd, package_parent) -> subprocess.CompletedProcess:
    """``lint-imports`` on the package under ``package_parent``: ``python -S`` so that no .pth file
    (the editable install's finder) can put the real package in the copy's place."""
    path = os.pathsep.join([str(package_parent), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-S", "-c", LINT, "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_rules_hold():
    done = lint(REPO, REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def test_a_planted_import_inside_a_function_breaks_both_rules(tmp_path):
    """config (pure) importing trainer (driver) inside a function: a layer broken and a circle made."""
    shutil.copytree(PACKAGE, tmp_path / "raytrain_hymt", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "raytrain_hymt" / "config.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _planted():\n    from raytrain_hymt.driver.train import run_training\n\n    return run_training\n")
    done = lint(tmp_path, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Contracts: 0 kept, 2 broken." in done.stdout
    assert "raytrain_hymt.config.schema -> raytrain_hymt.driver.train" in done.stdout


def test_every_module_is_in_one_layer():
    placed = [m for layer in layers() for m in layer]
    assert len(placed) == len(set(placed))
    assert sorted(set(modules()) - set(placed)) == []


def module_level_imports(source: str) -> set[str]:
    """Top-level package names a module imports when it is imported (not inside functions or classes)."""
    found: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)  # annotations only: never imported at run time
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # still run at import time
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(source).body)
    return found


def test_module_level_imports_are_told_from_function_level_ones():
    source = ("import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import mlflow\ntry:\n"
              "    import torch\nexcept ImportError:\n    pass\n\ndef f():\n    import ray\n")
    assert module_level_imports(source) == {"os", "typing", "torch"}


def test_pure_modules_import_no_heavy_framework_at_module_level():
    pure = layers()[-1]
    heavy = {m: sorted(module_level_imports((REPO / (m.replace(".", "/") + ".py")).read_text()) & HEAVY)
             for m in pure if (REPO / (m.replace(".", "/") + ".py")).exists()}
    assert {m: h for m, h in heavy.items() if h} == {}


def test_no_module_is_over_400_lines():
    lengths = {m: len((REPO / (m.replace(".", "/") + ".py")).read_text().splitlines()) for m in modules()}
    assert {m: n for m, n in lengths.items() if n > MAX_LINES} == {}
