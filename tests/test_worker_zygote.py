"""tests/startup/worker_zygote.py, from which the suite's Ray workers are forked: a worker started through it
runs as it would have run alone (its arguments, environment, folder, streams, exit status and signals),
and one it cannot stand for starts as usual. The stand-ins here are scripts named ``default_worker.py``, as
Ray's is, started as a raylet starts a worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import STARTUP

#: What a worker prints first: whether it found torch and Ray imported before its own code ran (the zygote
#: imports torch, not Ray), and who its parent is.
_REPORT = """
import os, sys
print("torch, ray before me:", "torch" in sys.modules, "ray" in sys.modules, "parent:", os.getppid(),
      "argv:", sys.argv[1:], flush=True)
"""


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    """A zygote of this test's own, as conftest.py starts the suite's."""
    folder = tmp_path_factory.mktemp("zygote")
    socket = folder / "socket"
    env = {**os.environ, "PYTHONPATH": str(STARTUP)}
    process = subprocess.Popen([sys.executable, str(STARTUP / "worker_zygote.py"), str(socket)], env=env,
                               stdout=subprocess.DEVNULL, stderr=open(folder / "stderr", "w"))
    deadline = time.monotonic() + 120
    while not socket.exists():
        assert process.poll() is None and time.monotonic() < deadline, (folder / "stderr").read_text()
        time.sleep(0.1)
    yield process, socket
    process.kill()
    process.wait()


def _worker(tmp_path, socket, code: str, **env: str) -> subprocess.Popen:
    script = tmp_path / "default_worker.py"
    script.write_text(_REPORT + code)
    env = {**os.environ, "PYTHONPATH": str(STARTUP), "HYMT_TEST_WORKER_ZYGOTE": str(socket), **env}
    return subprocess.Popen([sys.executable, str(script), "--flag=1"], env=env, cwd=tmp_path, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_worker_runs_in_a_child_of_the_zygote_as_it_would_alone(zygote, tmp_path):
    process, socket = zygote
    # Ray sets OMP_NUM_THREADS for a worker's CPUs before the worker's code imports torch.
    code = """
os.environ["OMP_NUM_THREADS"] = "1"
import torch
print("cwd:", os.getcwd() == sys.argv[0].rsplit("/", 1)[0], "path[0]:", sys.path[0] == os.getcwd())
print("env:", os.environ["HYMT_PROBE"], "threads:", torch.get_num_threads())
print("to stderr", file=sys.stderr)
sys.exit(3)
"""
    worker = _worker(tmp_path, socket, code, HYMT_PROBE="probe")
    out, err = worker.communicate(timeout=60)
    assert out.splitlines() == [
        f"torch, ray before me: True False parent: {process.pid} argv: ['--flag=1']",
        "cwd: True path[0]: True",
        "env: probe threads: 1",
    ]
    assert err.splitlines()[-1] == "to stderr" and worker.returncode == 3


def test_a_worker_with_another_environment_starts_as_usual(zygote, tmp_path):
    _, socket = zygote
    worker = _worker(tmp_path, socket, "", TRANSFORMERS_VERBOSITY="error")
    out, _ = worker.communicate(timeout=60)
    assert out.splitlines() == [f"torch, ray before me: False False parent: {os.getpid()} argv: ['--flag=1']"]
    assert worker.returncode == 0
    assert "declined" in (socket.parent / "socket.log").read_text().splitlines()[-1]


def test_signals_reach_the_child_and_a_killed_stand_in_takes_its_child_along(zygote, tmp_path):
    _, socket = zygote
    code = "print(os.getpid(), flush=True)\nimport time\ntime.sleep(60)\n"
    terminated = _worker(tmp_path, socket, code)
    terminated.stdout.readline()
    child = int(terminated.stdout.readline())
    terminated.send_signal(signal.SIGTERM)
    assert terminated.wait(timeout=30) == -signal.SIGTERM
    assert not _alive(child)

    killed = _worker(tmp_path, socket, code)
    killed.stdout.readline()
    child = int(killed.stdout.readline())
    killed.kill()
    killed.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stand_in_gone_before_its_request_leaves_the_zygote_serving(zygote, tmp_path):
    import socket as sockets

    process, socket = zygote
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as early:
        early.connect(str(socket))
    out, _ = _worker(tmp_path, socket, "").communicate(timeout=60)
    assert out.split()[:7] == ["torch,", "ray", "before", "me:", "True", "False", "parent:"]
    assert out.split()[7] == str(process.pid)
