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
"""

import gc

_gen0, _gen1, _ = gc.get_threshold()
gc.set_threshold(_gen0, _gen1, 1000)
