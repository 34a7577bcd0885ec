"""The driver's Ray session: join the cluster in ``RAY_ADDRESS`` or start a local Ray, quietly, with the
run's environment in place. Only driver code (trainer, evaluate, translate, tune, prepare, export) starts Ray."""

from __future__ import annotations

import contextlib
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
    start_local_ray(want, **ray_init_kwargs())
    return True


def start_local_ray(num_cpus: int, **init_kwargs) -> None:
    """A local Ray of ``num_cpus`` logical CPUs with its dashboard, whose processes ask that dashboard.

    The dashboard serves Ray's State API, which Ray Train's placement-group cleaner needs to see that a
    trial's controller died: without it every trial Tune stops leaves its workers' resources reserved.
    The cleaner asks without an address, so Ray takes the one in <tmp>/ray/ray_current_cluster, which the
    last `ray start` wrote and which stays when that cluster dies, or looks for a running GCS, and finds
    none or another Ray's: every fit then waited 12 s at its end for the cleaner and a search leaked
    stopped trials' workers. The processes of this Ray inherit the environment its raylet starts with, so
    they are pointed at its own dashboard; this process's environment is left as it was.
    """
    import ray

    port = _dashboard_port()
    with _environ(RAY_API_SERVER_ADDRESS=f"http://127.0.0.1:{port}"):
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_port=port, **init_kwargs)


def _dashboard_port() -> int:
    """Ray's usual dashboard port, 8265, where users look for it, or any free port while that one is taken."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 8265))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(**values: str):
    """``values`` in this process's environment inside the block only (what it starts keeps them)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def use_driver_env(cfg: Config) -> None:
    """Put ``scaling.env`` into this (the driver's) environment.

    The driver reads and writes the run folder itself, and a local Ray it starts passes its environment on
    to every process (Ray Train's controller too), so an object store's endpoint has to be in place first.
    """
    os.environ.update(cfg.scaling.env)
