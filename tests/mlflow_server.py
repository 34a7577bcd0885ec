"""A real ``mlflow server`` for tests: ``with run_mlflow_server(db_path, port) as url: ...``.

The server starts child processes (uvicorn; huey job consumers unless disabled) that outlive a kill of
the parent, so it runs in its own process group and the whole group is stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a foreign process reused the id
        return False
    return True


def _stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left after ``grace_s``."""
    pgid = proc.pid  # start_new_session=True: the group id is the leader's pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@contextlib.contextmanager
def run_mlflow_server(
    db_path: str | Path,
    port: int,
    *,
    artifacts_dir: str | Path | None = None,
    log_path: str | Path | None = None,
    startup_timeout_s: float = 60.0,
    job_execution: bool = False,
) -> Iterator[str]:
    """Run ``mlflow server`` on 127.0.0.1:``port`` over the sqlite DB ``db_path``; yield its URL.

    Restarting on the same ``db_path`` and ``port`` continues the same store (outage tests).
    ``job_execution=False`` skips MLflow's huey job consumers (~7 extra processes, unused by tracking).
    Server output goes to ``log_path`` (default: ``<db dir>/mlflow-server-<port>.log``, appended).
    """
    db_path = Path(db_path).resolve()
    db_path.parent.mkdir(parents=True, exist_ok=True)
    artifacts = Path(artifacts_dir) if artifacts_dir else db_path.parent / "mlartifacts"
    log_file = Path(log_path) if log_path else db_path.parent / f"mlflow-server-{port}.log"
    url = f"http://127.0.0.1:{port}"
    mlflow_cli = Path(sys.executable).parent / "mlflow"
    command = [
        str(mlflow_cli), "server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--workers", "1",
        "--backend-store-uri", f"sqlite:///{db_path}",
        "--artifacts-destination", str(artifacts.resolve()),
    ]  # fmt: skip
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION=str(job_execution).lower())
    env.pop("MLFLOW_TRACKING_URI", None)
    with open(log_file, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(
            command,
            cwd=db_path.parent,  # anything the server writes relative to its cwd stays in the test dir
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not _healthy(url):
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}; see {log_file}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlflow server not healthy after {startup_timeout_s} s; see {log_file}")
            time.sleep(0.2)
        yield url
    finally:
        _stop_group(proc)
