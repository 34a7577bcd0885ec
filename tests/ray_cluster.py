"""Start a real `ray start --head` cluster on loopback for a test (optionally with more nodes), and stop
exactly that cluster.

`ray stop` would kill every Ray on the machine (including the test session's own), so each node runs with
`--block` in its own process group, temp dir and ports: every process it starts stays in that group, and
the group is stopped with SIGTERM (graceful drain), then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow_server import _stop_group, free_port

BIN = Path(sys.executable).parent


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


@contextlib.contextmanager
def ray_head(num_cpus: int = 6, worker_nodes: tuple[int, ...] = ()):
    """Yield ``(dashboard_url, env)`` of a fresh head node; ``env`` lets the Ray CLI talk to it.

    ``worker_nodes``: one more node per entry, joined to the head, with that many logical CPUs.
    """
    ports = {name: free_port() for name in ("port", "dashboard-port", "ray-client-server-port")}
    # The job's `python` is the first one on the PATH of the `ray start` process (FACTS.md).
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    nodes = [_start_node(["--head", "--dashboard-host=127.0.0.1", f"--num-cpus={num_cpus}",
                          *(f"--{k}={v}" for k, v in ports.items())], env)]
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        _wait_for(f"{url}/api/version", 90)
        for cpus in worker_nodes:
            nodes.append(_start_node([f"--address=127.0.0.1:{ports['port']}", f"--num-cpus={cpus}"], env))
        if worker_nodes:
            _wait_for_nodes(env, url, 1 + len(worker_nodes), 90)
        yield url, env
    finally:
        for proc in reversed(nodes):
            _stop_group(proc, grace_s=20)  # SIGTERM: each `ray start --block` drains its node; then SIGKILL


def alive_node_ids(env: dict, url: str) -> set[str]:
    """The ids of the cluster's alive nodes (``ray list nodes``)."""
    import json

    listed = subprocess.run([str(BIN / "ray"), "list", "nodes", "--address", url, "--format", "json",
                             "--filter", "state=ALIVE"], env=env, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0 or not listed.stdout.startswith("["):  # "No resource in the cluster" at first
        return set()
    return {n["node_id"] for n in json.loads(listed.stdout)}


def _wait_for_nodes(env: dict, url: str, count: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while len(alive_node_ids(env, url)) < count:
        if time.time() > deadline:
            raise TimeoutError(f"the cluster at {url} did not reach {count} nodes within {timeout_s} s")
        time.sleep(1)
