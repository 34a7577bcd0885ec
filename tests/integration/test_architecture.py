"""The house's rules (docs/architecture.md): folders named for where their code runs, layers and no import
circle (import-linter and grimp, which see imports inside functions too), no heavy framework imported at
module level by a pure module, every module in a layer."""

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
#: The package's top level: the command line and the shared vocabulary; everything else is in a folder.
MAX_TOP_LEVEL_MODULES = 8
#: Pure logic: no Ray, torch, DeepSpeed or MLflow imported at module level.
PURE = ("raytrain_hymt.config.", "raytrain_hymt.errors", "raytrain_hymt.languages", "raytrain_hymt.storage",
        "raytrain_hymt.tokenizer", "raytrain_hymt.data.cleaning", "raytrain_hymt.data.prompts",
        "raytrain_hymt.data.packing", "raytrain_hymt.data.epochs", "raytrain_hymt.data.stats")
LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def layered(contract: dict) -> list[str]:
    """Every package or module a layers contract places, as dotted names."""
    (container,) = contract["containers"]
    return [f"{container}.{m.strip()}" for layer in contract["layers"] for m in layer.replace("|", ":").split(":")]


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
    assert "Contracts: 3 kept, 0 broken." in done.stdout


def test_a_planted_import_inside_a_function_breaks_every_rule(tmp_path):
    """config (pure) importing the driver's training inside a function: a layer broken and a circle made."""
    shutil.copytree(PACKAGE, tmp_path / "raytrain_hymt", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    with open(tmp_path / "raytrain_hymt" / "config" / "schema.py", "a", encoding="utf-8") as f:
        f.write("\n\ndef _planted():\n    from raytrain_hymt.driver.train import run_training\n\n    return run_training\n")
    done = lint(tmp_path, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    # The data contract breaks too: data.cleaning now reaches data.tokenize through config and the driver.
    assert "Contracts: 0 kept, 3 broken." in done.stdout
    assert "raytrain_hymt.config.schema -> raytrain_hymt.driver.train" in done.stdout


def test_every_module_is_in_one_layer():
    """The top layers contract places every folder and top-level module; the data contract every module
    of data/; each exactly once."""
    top, data = (layered(c) for c in contracts()[:2])
    for placed in (top, data):
        assert len(placed) == len(set(placed))
    children = {".".join(m.split(".")[:2]) for m in modules()}
    assert sorted(children - set(top)) == [] and sorted(set(top) - children) == []
    in_data = {m for m in modules() if m.startswith("raytrain_hymt.data.")}
    assert sorted(in_data ^ set(data)) == []


def test_the_top_level_holds_at_most_eight_modules_and_the_rest_are_folders():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert folders == ["config", "console", "data", "driver", "evaluation", "tracking", "train"]


def test_grimp_finds_no_import_circle():
    """No circle among the package's modules, imports inside functions counted (grimp records them)."""
    import grimp

    graph = grimp.build_graph("raytrain_hymt", cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    # Tarjan's strongly connected components: a component of more than one module is a circle.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(m):
        index[m] = low[m] = counter[0]
        counter[0] += 1
        stack.append(m)
        on_stack.add(m)
        for n in edges[m]:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for m in sorted(edges):
        if m not in index:
            visit(m)
    assert circles == []


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
    pure = [m for m in modules() if m.startswith(PURE)]
    assert len(pure) >= 10
    heavy = {m: sorted(module_level_imports((REPO / (m.replace(".", "/") + ".py")).read_text()) & HEAVY) for m in pure}
    assert {m: h for m, h in heavy.items() if h} == {}
