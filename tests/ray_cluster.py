"""Start a real `ray start --head` cluster on loopback for a test, and stop exactly that cluster.

`ray stop` would kill every Ray on the machine (including the test session's own), so the head runs with
`--block` in its own process group: every process it starts stays in that group, and the group is
stopped with SIGTERM (graceful drain), then SIGKILL.
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


@contextlib.contextmanager
def ray_head(num_cpus: int = 6):
    """Yield ``(dashboard_url, env)`` of a fresh head node; ``env`` lets the Ray CLI talk to it."""
    temp_dir = tempfile.mkdtemp(prefix="hymt-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    ports = {name: free_port() for name in ("port", "dashboard-port", "ray-client-server-port",
                                           "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                           "runtime-env-agent-port", "metrics-export-port",
                                           "node-manager-port", "object-manager-port")}
    # The job's `python` is the first one on the PATH of the `ray start` process (FACTS.md).
    env = dict(os.environ, PATH=f"{BIN}:{os.environ.get('PATH', '')}", RAY_AUTH_MODE="token")
    env.pop("RAY_ADDRESS", None)
    args = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1", f"--num-cpus={num_cpus}", "--disable-usage-stats",
            f"--temp-dir={temp_dir}", "--min-worker-port=0", "--max-worker-port=0",
            *(f"--{k}={v}" for k, v in ports.items())]
    log = open(Path(temp_dir) / "ray-start.log", "w")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        _wait_for(f"{url}/api/version", 90)
        yield url, env
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
