"""The driver's Ray session: join the cluster in ``RAY_ADDRESS`` or start a local Ray, quietly, with the
run's environment in place. Only driver code (trainer, evaluate, translate, tune, prepare, export) starts Ray."""

from __future__ import annotations

import os

from raytrain_hymt.config import Config


def init_ray(cfg: Config) -> bool:
    """Join the cluster in ``RAY_ADDRESS`` (e.g. under ``ray job submit``) or start a local Ray.

    Returns True when this call started a local Ray (no other node can ever join it), False when it
    joined a cluster or Ray was already initialized.
    """
    import ray

    from raytrain_hymt.quiet import quiet_ray, ray_init_kwargs

    quiet_ray(driver=True)
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**ray_init_kwargs())
        return False
    # 2 training workers plus the tokenizer actors need more logical CPUs than a 2-core machine has
    # (FACTS.md: on 2 logical CPUs the actors never start). Logical CPUs are only a scheduling count.
    want = cfg.scaling.local_num_cpus or max(4, os.cpu_count() or 1, int(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker) + cfg.data.tokenize_actors)
    # The dashboard serves Ray's State API, which Ray Train's placement-group cleaner needs to see that a
    # trial's controller died: without it every trial Tune stops leaves its workers' resources reserved.
    ray.init(address="local", num_cpus=want, include_dashboard=True, **ray_init_kwargs())
    return True


def use_driver_env(cfg: Config) -> None:
    """Put ``scaling.env`` into this (the driver's) environment.

    The driver reads and writes the run folder itself, and a local Ray it starts passes its environment on
    to every process (Ray Train's controller too), so an object store's endpoint has to be in place first.
    """
    os.environ.update(cfg.scaling.env)
