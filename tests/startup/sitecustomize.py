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

DeepSpeed's ZeRO optimizer imports its Muon module at the first gradient reduction (an ``isinstance``
check), and that module decorates three kernels with ``torch.compile`` at import, which loads dynamo's
compiler stack (aot_autograd, inductor, networkx): 1.6 CPU-s in each training worker here, for kernels no
test calls (no preset uses Muon). ``defer_muon_compile`` makes DeepSpeed's ``compiler.compile()`` compile a
kernel at its first call instead, with the same ``torch.compile``; what the kernels compute is unchanged.
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


class _DeferMuonCompile(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.runtime.compiler`` as usual and swaps its ``compile`` once the module has run."""

    MODULE = "deepspeed.runtime.compiler"

    def find_spec(self, name, path, target=None):
        if name != self.MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.compile = compile_at_first_call

        spec.loader.exec_module = exec_module
        return spec


def defer_muon_compile() -> None:
    """Install the finder (once) ahead of the standard ones."""
    if not any(isinstance(f, _DeferMuonCompile) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferMuonCompile())


defer_muon_compile()
