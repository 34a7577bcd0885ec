"""Start a real `ray start --head` cluster on loopback (optionally with more nodes), kill and bring back
its other nodes, and stop exactly that cluster.

`ray stop` would kill every Ray on the machine (including the test session's own), so each node runs with
`--block` in its own process group, temp dir and ports: every process it starts stays in that group, and
the group is stopped with SIGTERM (graceful drain), then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow_server import free_port

BIN = Path(sys.executable).parent
#: What Ray Train's placement-group cleaner writes when its watch ends early (it could not reach the State API).
CLEANER_DIED = "Exception in thread PlacementGroupCleanerMonitor"
REPO = Path(__file__).resolve().parents[1]


def _wait_for(url: str, timeout_s: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # an answer (401 without the auth token) means the server is up
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")


NODE_PORTS = ("node-manager-port", "object-manager-port", "metrics-export-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port")


def _start_node(args: list[str], env: dict) -> subprocess.Popen:
    """``ray start ... --block`` in a new process group, logging to ``<temp dir>/ray-start.log``."""
    temp_dir = tempfile.mkdtemp(prefix="hymt-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    ports = [f"--{name}={free_port()}" for name in NODE_PORTS]
    with open(Path(temp_dir) / "ray-start.log", "w") as log:
        return subprocess.Popen(
            [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats",
             f"--temp-dir={temp_dir}", "--min-worker-port=0", "--max-worker-port=0", *ports, *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )


class LoopbackCluster:
    """A ``ray start`` head on loopback plus more nodes, each a process group of this test process; the
    nodes after the head can be killed (a lost machine) and brought back (``restore``).

    ``url``: the dashboard (jobs, state API); ``address``: the GCS, for ``ray.init(address=...)`` in a
    driver process; ``env``: lets the Ray CLI and such a driver talk to the cluster (token auth).
    """

    def __init__(self, num_cpus: int = 6, worker_nodes: tuple[int, ...] = ()):
        """``worker_nodes``: one more node per entry, joined to the head, with that many logical CPUs."""
        ports = {name: free_port() for name in ("port", "dashboard-port", "ray-client-server-port")}
        # The job's `python` is the first one on the PATH of the `ray start` process (FACTS.md).
        # PYTHONPATH: the workers of a driver that connects to the cluster (tests/two_node_run.py) import
        # this checkout's package, as the workers of a job submitted with --working-dir do.
        self.env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", RAY_AUTH_MODE="token",
                        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.env.pop("RAY_ADDRESS", None)
        self.address = f"127.0.0.1:{ports['port']}"
        self.url = f"http://127.0.0.1:{ports['dashboard-port']}"
        # Its processes ask its own State API, as jobs/slurm/train.sbatch's head does: the test session's
        # Ray runs on this machine too, and Ray Train's placement-group cleaner, left to find one, stops.
        self.env["RAY_API_SERVER_ADDRESS"] = self.url
        # The GCS declares a switched-off node dead after this many failed health checks this far apart
        # (Ray's defaults: 5 every 3 s, ~15 s of waiting per lost node). A live node that answers late is
        # still given Ray's 10 s per check, so a busy machine does not lose a node by mistake.
        self.env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
        self.worker_cpus = worker_nodes
        self.head = _start_node(["--head", "--dashboard-host=127.0.0.1", f"--num-cpus={num_cpus}",
                                 *(f"--{k}={v}" for k, v in ports.items())], self.env)
        self.workers: list[subprocess.Popen | None] = [None] * len(worker_nodes)
        #: Each node's id after the head (its latest start).
        self.node_id: list[str | None] = [None] * len(worker_nodes)
        try:
            _wait_for(f"{self.url}/api/version", 90)
            self.head_node_id = _wait_for_new_node(self.env, self.url, set(), 90)
            self.restore()
        except BaseException:
            self.close()
            raise

    def node_ids(self) -> set[str]:
        """The ids of the cluster's alive nodes."""
        return alive_node_ids(self.env, self.url)

    def kill_node(self, index: int = 0) -> None:
        """SIGKILL worker node ``index`` (its raylet, object store and workers) at once, as a machine that
        is switched off: no drain, the GCS finds the node dead on its own."""
        _switch_off(self.workers[index])
        self.workers[index] = None

    def restore(self, timeout_s: float = 120) -> None:
        """Start every worker node that is not running (again, with its logical CPUs), one at a time, and
        wait until each is alive: the next user finds the cluster whole."""
        if self.head.poll() is not None:  # closed: nothing to bring back
            return
        for index, cpus in enumerate(self.worker_cpus):
            if self.workers[index] is not None:
                continue
            before = self.node_ids()
            self.workers[index] = _start_node([f"--address={self.address}", f"--num-cpus={cpus}"], self.env)
            self.node_id[index] = _wait_for_new_node(self.env, self.url, before, timeout_s)

    @property
    def worker_node_ids(self) -> set[str]:
        """The node ids of the nodes after the head that run now."""
        return {self.node_id[i] for i, proc in enumerate(self.workers) if proc is not None}

    def close(self) -> None:
        """Stop every node at once, as ``kill_node`` does (a graceful drain of each node took ~20 s of an
        idle wait, and nothing of a test cluster needs to outlive it); idempotent."""
        for proc in [p for p in reversed(self.workers) if p is not None] + [self.head]:
            if proc.poll() is None:
                _switch_off(proc)
        self.workers = [None] * len(self.worker_cpus)


def _switch_off(proc: subprocess.Popen) -> None:
    """SIGKILL a node's ``ray start --block`` process group and every process below it."""
    # Ray starts each worker process in a session of its own, outside the node's process group: without
    # killing them too, a training worker of the "switched off" node kept training until it noticed its
    # raylet was gone (several steps under load, which made the elastic test's schedule flaky).
    doomed = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


def alive_node_ids(env: dict, url: str) -> set[str]:
    """The ids of the cluster's alive nodes, from its State API (what ``ray list nodes`` asks: one HTTP
    request instead of a Ray CLI process, ~2 CPU-s each, polled every second while a node joins)."""
    import json
    import urllib.error
    import urllib.request

    try:
        token = env.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").read_text().strip()
        request = urllib.request.Request(f"{url}/api/v0/nodes?limit=10000",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            nodes = json.load(answer)["data"]["result"]["result"]
    except (urllib.error.URLError, OSError, KeyError, ValueError):  # not serving yet
        return set()
    return {n["node_id"] for n in nodes if n["state"] == "ALIVE"}


def _wait_for_new_node(env: dict, url: str, before: set[str], timeout_s: float) -> str:
    """The id of the one node that is alive now and was not in ``before``, once it is."""
    deadline = time.time() + timeout_s
    while True:
        new = alive_node_ids(env, url) - before
        if len(new) == 1:
            return new.pop()
        if time.time() > deadline:
            raise TimeoutError(f"no new node joined the cluster at {url} within {timeout_s} s (new: {new})")
        time.sleep(1)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found
