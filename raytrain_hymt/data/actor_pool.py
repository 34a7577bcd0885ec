"""Ray Data actor pools (the tokenizers of the data pipeline, the translating replicas of evaluation)
whose actors Ray never restarts.

Ray Data starts every pool actor with ``max_restarts=-1`` unless told otherwise, and always hands it
object references as constructor arguments (its DataContext and the fused map functions). Ray Core then
prints, once per driver, an ERROR line from ``core_worker.cc``: "Actor with class name:
'MapWorker(...)' ... has constructor arguments in the object store and max_restarts > 0"
(ray-project/ray#53727, and #57733 for Ray Data). ``max_restarts=0`` removes that cause. It also means
that a pool actor that dies (a crash in the tokenizer, an OOM kill) fails the execution with the error,
where before the same batch was retried on a restarted actor without end (Ray Data also sets
``max_task_retries=-1``), which turns a crash that repeats into a hang. An actor that dies while it is
still starting is replaced by Ray Data either way. Ray 2.60 has no named parameter for this yet:
``map_batches``' ``**ray_remote_args`` are deprecated for 2.64, hence the warning filter.
"""

from __future__ import annotations

import warnings


def map_on_actors(ds, fn, size: int, **map_args):
    """``ds.map_batches(fn, **map_args)`` on a fixed pool of ``size`` actors that are never restarted."""
    from ray.data import ActorPoolStrategy

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`ray_remote_args` is deprecated")
        return ds.map_batches(fn, compute=ActorPoolStrategy(size=size), max_restarts=0, **map_args)
