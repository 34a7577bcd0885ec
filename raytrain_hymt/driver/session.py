"""The driver's Ray session: join the cluster in ``RAY_ADDRESS`` or start a local Ray, quietly, with the
run's environment in place, and check that the cluster can ever start the run's workers. Only driver code
(and the command line) starts Ray.

Ray Train waits for resources without end: a GPU preset on a machine without GPUs would run the whole
data pipeline and then hang. The decision is a pure function of plain dicts (``resource_shortfall``);
``check_cluster_resources`` feeds it what Ray reports.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter

from raytrain_hymt.config.schema import Config
from raytrain_hymt.errors import ConfigError


def init_ray(cfg: Config) -> bool:
    """Join the cluster in ``RAY_ADDRESS`` (e.g. under ``ray job submit``) or start a local Ray.

    Returns True when this call started a local Ray (no other node can ever join it), False when it
    joined a cluster or Ray was already initialized.
    """
    import ray

    from raytrain_hymt.console.quiet import quiet_ray, ray_init_kwargs

    quiet_ray(driver=True)
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**ray_init_kwargs())
        return False
    # 2 training workers plus the tokenizer actors need more logical CPUs than a 2-core machine has
    # (measured: on 2 logical CPUs the actors never start). Logical CPUs are only a scheduling count.
    want = cfg.scaling.local_num_cpus or max(4, os.cpu_count() or 1, int(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker) + cfg.data.tokenize_actors)
    start_local_ray(want, **ray_init_kwargs())
    return True


#: Starts of a local Ray that may each find their dashboard port taken before giving up.
PORT_ATTEMPTS = 5

#: Where a local Ray without a dashboard points its processes' State API: nothing can listen on port 0, so
#: every question fails at once (Ray Train's cleaner then keeps waiting) instead of reaching another Ray's
#: dashboard on this machine, whose "no such actor" would make the cleaner remove this run's workers.
NO_API_SERVER = "http://127.0.0.1:0"


def start_local_ray(num_cpus: int, **init_kwargs) -> None:
    """A local Ray of ``num_cpus`` logical CPUs with its dashboard, whose processes ask that dashboard.

    The dashboard serves Ray's State API, which Ray Train's placement-group cleaner needs to see that a
    trial's controller died: without it every trial Tune stops leaves its workers' resources reserved.
    The cleaner asks without an address, so Ray takes the one in <tmp>/ray/ray_current_cluster, which the
    last `ray start` wrote and which stays when that cluster dies, or looks for a running GCS, and finds
    none or another Ray's: every fit then waited 12 s at its end for the cleaner and a search leaked
    stopped trials' workers. The processes of this Ray inherit the environment its raylet starts with, so
    they are pointed at its own dashboard; this process's environment is left as it was.

    Where the dashboard's packages are missing (``ray`` without ``[default]``) Ray starts without it, with
    one warning. Ray tries other dashboard ports only when it chooses the port itself, and the address has
    to be known before it starts, so a port another process takes between the choice and Ray's bind (two
    ``hymt`` commands started together) starts Ray again on another port, up to ``PORT_ATTEMPTS`` times.
    The dashboard's is the only fixed port ``ray.init`` binds on a local start that way: the GCS, raylet,
    object manager, metrics and runtime-env agent ports are bound by their own processes on any free port,
    Ray Client's 10001 is opened by ``ray start --head`` only, and a dashboard agent finding its HTTP port
    (52365, which ``ray.init`` cannot set) taken runs without that service, which only job submission uses.
    """
    import ray

    missing = dashboard_packages_missing()
    if missing:
        _start_without_dashboard(num_cpus, f"its packages are missing ({missing}; pip install 'ray[default]' "
                                 "adds them)", **init_kwargs)
        return
    taken = []
    for _ in range(PORT_ATTEMPTS):
        port = _dashboard_port()
        try:
            with (_environ(RAY_API_SERVER_ADDRESS=f"http://127.0.0.1:{port}"), _ending_a_failed_start(),
                  _unless_the_dashboard_failed("ray._private.services")):
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, dashboard_port=port,
                         **init_kwargs)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its dashboard exits
            if not _port_was_taken(e):
                failed = _dashboard_failed(e)
                if failed is None:
                    raise
                _start_without_dashboard(num_cpus, f"it exited at its start ({failed})", **init_kwargs)
                return
            taken.append(port)
            if len(taken) < PORT_ATTEMPTS:
                log.info("Ray's dashboard port %d was taken while Ray started (another Ray starting beside this "
                         "one); starting again on another port", port)
    raise RuntimeError(f"a local Ray could not start: its dashboard port was taken by another process while "
                       f"Ray started, {PORT_ATTEMPTS} times (ports {', '.join(map(str, taken))})")


def _start_without_dashboard(num_cpus: int, why: str, **init_kwargs) -> None:
    """A local Ray without a dashboard, after one warning that says why and what degrades."""
    import ray

    log.warning("Ray's dashboard cannot start, %s: the local Ray runs without it, so Ray Train's placement-group "
                "cleaner cannot free the workers of a run whose controller died, and hymt tune refuses to start",
                why)
    with _environ(RAY_API_SERVER_ADDRESS=NO_API_SERVER):
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **init_kwargs)


def _dashboard_failed(error: Exception) -> str | None:
    """The last line of the dashboard's own error when ``ray.init`` failed because the dashboard process
    exited at its start for a reason other than its port (e.g. a Ray installed without the dashboard's web
    build: ``FrontendNotFoundError``), else None. Ray 2.60 raises a bare ``Exception`` holding the end of
    dashboard.log after the words below."""
    text = str(error)
    if "(it contains the error message from the dashboard)" not in text:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300]


def dashboard_packages_missing() -> ImportError | None:
    """Why Ray's dashboard cannot start in this Python (its optional packages missing), or None.

    Ray 2.60 decides by importing ``ray.dashboard.optional_deps`` (``ray._private.utils.
    get_dashboard_dependency_error``) and, asked for a dashboard it cannot start, refuses to start at all;
    tests/integration/test_session.py fails if the two disagree.
    """
    try:
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as e:
        return e
    return None


def _port_was_taken(error: Exception) -> bool:
    """Whether ``ray.init`` failed because another process held the dashboard port.

    Ray 2.60 says so in two ways, matched by their text (tests/integration/test_session.py forces both):
    its own check before it starts the dashboard raises ``ValueError("Failed to bind to HOST:PORT because
    it's already occupied ...")``; a port taken after that check makes the dashboard exit, and ``ray.init``
    raises an ``Exception`` holding the end of dashboard.log, with "Failed to find a valid port for
    dashboard".
    """
    text = str(error)
    return "because it's already occupied" in text or "Failed to find a valid port for dashboard" in text


@contextlib.contextmanager
def _ending_a_failed_start():
    """Stop the processes a failed ``ray.init`` started (the GCS and the monitor stay otherwise, until this
    process exits, since Ray has no node to shut down yet) and reset Ray's state in this process."""
    import psutil
    import ray

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        yield
    except BaseException:
        started = [p for p in me.children(recursive=True) if p.pid not in before]
        for p in started:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(started, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        ray.shutdown()
        raise


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _unless_the_dashboard_failed(name: str):
    """The records logger ``name`` writes inside the block, passed on after it, unless its dashboard failed
    (a taken port, or an exit at its start): such a dashboard logs the end of its dashboard.log as errors,
    moot once Ray starts again (on another port, or without it after one warning)."""
    logger = logging.getLogger(name)
    kept, propagate = _Kept(), logger.propagate
    logger.addHandler(kept)
    logger.propagate = False
    try:
        yield
    except Exception as e:
        if _port_was_taken(e) or _dashboard_failed(e) is not None:
            kept.records.clear()
        raise
    finally:
        logger.removeHandler(kept)
        logger.propagate = propagate
        for record in kept.records:
            logger.handle(record)


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


log = logging.getLogger("raytrain_hymt")


def worker_resources(cfg: Config) -> dict[str, float]:
    """Logical resources one training worker reserves (as ``driver.train.build_trainer``'s ScalingConfig asks for them)."""
    need = {"CPU": float(cfg.scaling.cpus_per_worker)}
    if cfg.scaling.use_gpu:
        need["GPU"] = 1.0
    return need


def fewest_workers(cfg: Config) -> tuple[int, str]:
    """The fewest workers the run can start on, and the field that sets them: an elastic run starts on as
    many workers as fit, as long as that is at least ``scaling.min_workers``."""
    if cfg.scaling.min_workers is None:
        return cfg.scaling.num_workers, "scaling.num_workers"
    return cfg.scaling.min_workers, "scaling.min_workers"


def _amount(value: float, name: str) -> str:
    return f"{value:g} {name}{'' if value == 1 or name not in ('CPU', 'GPU') else 's'}"


def _fits(have: dict, need: dict) -> bool:
    # Ray reports resources as floats (fractional CPUs); the tolerance keeps 0.1 * 3 from missing 0.3.
    return all(have.get(name, 0.0) + 1e-9 >= amount for name, amount in need.items())


def resource_shortfall(need_per_worker: dict, workers: int, total: dict, per_node: list[dict],
                       *, local: bool = True, workers_field: str = "scaling.num_workers") -> str | None:
    """What the Ray cluster lacks to start ``workers`` training workers, as a message; None if nothing.

    ``need_per_worker``: :func:`worker_resources`; ``total``: ``ray.cluster_resources()``; ``per_node``:
    the ``Resources`` of each alive node in ``ray.nodes()``. ``local``: Ray was started by this job on
    this machine, so the message names the fix; otherwise (a cluster, whose autoscaler may add nodes) it
    says the job will wait. ``workers_field``: the config field ``workers`` comes from (an elastic run
    needs only ``scaling.min_workers``).
    """
    need = {name: amount for name, amount in need_per_worker.items() if amount > 0}
    where = "this machine has" if local else "the cluster now has"
    problems = []
    for name, amount in need.items():
        want, have = amount * workers, total.get(name, 0.0)
        if _fits(total, {name: want}):
            continue
        if name == "GPU":
            what = f"scaling.use_gpu=true needs {_amount(want, name)} ({workers_field}={workers})"
            fix = ("use --set scaling.use_gpu=false, a preset for CPU such as tiny-cpu, "
                   "or run on a GPU machine / cluster (RAY_ADDRESS)")
        elif name == "CPU":
            what = (f"{workers_field}={workers} x scaling.cpus_per_worker={amount:g} needs "
                    f"{_amount(want, name)}")
            fix = f"lower {workers_field} or scaling.cpus_per_worker, or raise scaling.local_num_cpus"
        else:
            what = f"{workers} workers need {_amount(want, name)}"
            fix = f"lower {workers_field}"
        problems.append(f"{what}, {where} {_amount(have, name)}" + (f": {fix}" if local else ""))
    if not problems and not any(_fits(node, need) for node in per_node):
        # Ray places a worker on one node: enough in total is not enough when every node is too small.
        one = " and ".join(_amount(amount, name) for name, amount in need.items())
        shapes = Counter(", ".join(_amount(node.get(name, 0.0), name) for name in need) for node in per_node)
        nodes = "; ".join(f"{count} x {shape}" if count > 1 else shape for shape, count in shapes.items())
        place = "of this machine's Ray" if local else "of the cluster now"
        what = f"one training worker needs {one} on a single node, no node {place} has that (nodes: {nodes})"
        problems.append(what + (": lower scaling.cpus_per_worker or run on bigger nodes" if local else ""))
    if not problems:
        return None
    if local:
        return "; ".join(problems)
    return "; ".join(problems) + "; the job will wait until the autoscaler adds nodes that have them"


def check_cluster_resources(cfg: Config, started_locally: bool) -> None:
    """Fail fast when Ray can never start the training workers ``cfg`` asks for.

    On a local Ray this job started (``started_locally``: no node can join later) a shortfall raises
    ``ConfigError`` naming the fix; on a cluster it logs a warning, since an autoscaler may add nodes.
    """
    import ray

    per_node = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    fewest, field = fewest_workers(cfg)
    message = resource_shortfall(worker_resources(cfg), fewest, ray.cluster_resources(), per_node,
                                 local=started_locally, workers_field=field)
    if message is None:
        return
    if started_locally:
        raise ConfigError(message)
    log.warning("%s", message)


def check_state_api() -> None:
    """Fail before a search starts when this cluster has no State API (Ray's dashboard is off).

    Ray Train removes a stopped trial's worker placement group from a watcher that asks the State API
    whether the trial's controller is still alive; without it the reservation is never freed, and once
    stopped trials hold the cluster's CPUs or GPUs the search waits forever for the next trial's workers.
    The API must answer for this cluster: without a dashboard of its own, Ray asks port 8265 on this
    machine, where another Ray's may run.
    """
    import ray
    from ray.util.state import list_nodes
    from ray.util.state.exception import RayStateApiException

    try:
        # This cluster's address: left to find one itself, the State API client refuses to choose when
        # several Ray instances run on the machine.
        nodes = list_nodes(address=ray.get_runtime_context().gcs_address, limit=10_000, timeout=10,
                           raise_on_missing_output=False)
    except RayStateApiException as e:
        reason = type(e).__name__
    else:
        if ray.get_runtime_context().get_node_id() in {n.node_id for n in nodes}:
            return
        reason = "the State API on this machine answers for another Ray cluster"
    # A local Ray started without its dashboard because this Python lacks the dashboard's packages: that is
    # the cause to name, whether nothing answered or another Ray's dashboard on this machine did.
    missing = dashboard_packages_missing()
    if missing:
        reason = f"its packages are missing: {missing}"
    raise ConfigError(
        f"hymt tune needs Ray's State API, served by the dashboard, which this cluster does not run ({reason}): "
        "without it every trial ASHA stops keeps its workers' CPUs/GPUs reserved and the search hangs once they "
        "are all held. Start the cluster with the dashboard (ray start --head without --include-dashboard=false; "
        "the dashboard's packages: pip install 'ray[default]')"
    )
