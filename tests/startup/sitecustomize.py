"""Run at start-up by every Python process of the test suite: conftest.py puts this folder first on
``PYTHONPATH``, which Ray's workers, the ``ray start`` clusters, the CLI subprocesses and Slurm's jobs
inherit. It only makes them start faster; the product does not ship it.

A Ray Train worker of this suite imports torch, DeepSpeed, transformers, mlflow and Ray: about 570,000
objects the collector tracks, nearly all of them kept. CPython 3.11 scans the whole heap each time gen1
has been collected 10 times and the long-lived objects have grown by a quarter: 8 full scans of a growing
heap during that import, about 1.3 of its 7 to 9 CPU-s here. With gen2's threshold at 1000 there are none
(``python -c "import gc; import raytrain_hymt.worker, deepspeed, mlflow, ...; print(gc.get_stats())"``).
The suite starts a few hundred such processes on two cores. Young objects are still collected as often
as before; only the full scans are rarer.

Three imports that no test uses in the process that makes them are deferred to their first use; what
runs is unchanged:
- DeepSpeed's ZeRO optimizer imports its Muon module at the first gradient reduction (an ``isinstance``
  check), and that module decorates three kernels with ``torch.compile`` at import, which loads dynamo's
  compiler stack (aot_autograd, inductor, networkx): ``compile_at_first_call`` calls the same
  ``torch.compile`` when a kernel is first called (no preset uses Muon);
- DeepSpeed's autotuner, which ``import deepspeed`` loads, imports mlflow for its own runs, which no test
  starts: it gets ``ImportedOnUse("mlflow")``, the real module once it reads an attribute (rank 0's
  tracker imports mlflow as usual);
- transformers' RoPE helpers import torch, which is how ``AutoTokenizer`` (through its config classes)
  brings torch into the tokenizer actors, which never use it: they get ``ImportedOnUse("torch")``.
Together 2.8 of the 5.0 CPU-s of ``import torch, transformers, ray.train.torch, deepspeed`` and the Muon
import in a fresh interpreter, and 1.2 of the 2.1 CPU-s of loading the tiny tokenizer (docs/suite-time.md).

One result is kept on disk for the processes after: the import structure transformers builds by reading
its model folders, 0.55 of the 3.3 CPU-s of ``from transformers import AutoConfig`` and loading the
model's module (``_cache_import_structure``).

A Ray worker process does not import torch, transformers and DeepSpeed itself when the session runs a
zygote that has: it runs in a child forked from it (worker_zygote.py, started by conftest.py).
"""

import functools
import gc
import importlib.abc
import importlib.machinery
import sys

_gen0, _gen1, _ = gc.get_threshold()
gc.set_threshold(_gen0, _gen1, 1000)


def compile_at_first_call():
    """A decorator like ``torch.compile``'s, that calls ``torch.compile`` on the function when it is first
    called rather than when it is decorated."""

    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                import torch

                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    return decorate


class ImportedOnUse:
    """Stands in for module ``name`` and imports it when one of its attributes is first read."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr):
        if sys.modules.get(self._name) is self:
            if attr.startswith("__"):  # the import system and inspect probe these while it stands in
                raise AttributeError(attr)
            del sys.modules[self._name]
        return getattr(importlib.import_module(self._name), attr)


def _compile_muon_at_first_call(run, module) -> None:
    run(module)
    module.compile = compile_at_first_call


def _imports_at_first_use(name: str):
    """Runs a module with ``ImportedOnUse(name)`` for ``import name`` (unless ``name`` is imported already)."""

    def around(run, module) -> None:
        if name in sys.modules:
            return run(module)
        stand_in = sys.modules[name] = ImportedOnUse(name)
        try:
            run(module)
        finally:
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]

    return around


def _cache_import_structure(run, module) -> None:
    """Keeps transformers' ``define_import_structure`` on disk. It builds the lazy modules ``transformers``
    and ``transformers.models`` by reading every file of the ~470 model folders (0.27 CPU-s each, so 0.55
    in each process that loads a tokenizer or a model class), and its result depends only on those files.
    An entry is keyed by the folder's path (the venv's), transformers' own path and the mtimes of the
    folder and of the module that reads it; a process that finds none computes and stores it."""
    import hashlib
    import os
    import pickle
    import tempfile
    from pathlib import Path

    run(module)
    define = module.define_import_structure
    store = Path(tempfile.gettempdir()) / f"hymt-import-structure-{os.getuid()}"
    reader = f"{module.__file__}|{os.stat(module.__file__).st_mtime_ns}"

    @functools.lru_cache  # as the original's: one structure per call, which transformers then extends
    def cached(module_path, prefix=None):
        folder = Path(module_path)
        folder = folder.parent if folder.is_file() else folder
        key = f"{folder}|{prefix}|{reader}|{folder.stat().st_mtime_ns}"
        entry = store / f"{hashlib.sha256(key.encode()).hexdigest()}.pickle"
        try:
            return pickle.loads(entry.read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError):
            pass
        structure = define(module_path, prefix)
        part = entry.with_suffix(f".{os.getpid()}")
        try:
            store.mkdir(exist_ok=True)
            part.write_bytes(pickle.dumps(structure))
            os.replace(part, entry)  # a reader finds a whole entry or none
        except OSError:  # a full or read-only temp dir: the next process scans again
            part.unlink(missing_ok=True)
        return structure

    cached.uncached = define
    module.define_import_structure = cached


#: Module -> how it is run: ``(run, module)``, where ``run(module)`` executes its code.
_AROUND = {
    "deepspeed.runtime.compiler": _compile_muon_at_first_call,
    "deepspeed.autotuning.autotuner": _imports_at_first_use("mlflow"),
    "transformers.modeling_rope_utils": _imports_at_first_use("torch"),
    "transformers.utils.import_utils": _cache_import_structure,
}


class _Deferring(importlib.abc.MetaPathFinder):
    """Finds the modules of ``_AROUND`` as usual and runs each through its wrapper."""

    def find_spec(self, name, path, target=None):
        around = _AROUND.get(name)
        if around is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: around(run, module)
        return spec


sys.meta_path.insert(0, _Deferring())  # ahead of the standard finders

# A Ray worker (the raylet runs `python .../default_worker.py ARGS`) runs in a child of the session's zygote
# when there is one, and starts as usual otherwise (worker_zygote.py).
if sys.argv and sys.argv[0].endswith("default_worker.py"):
    from worker_zygote import start_in_zygote

    start_in_zygote()
