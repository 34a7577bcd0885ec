"""The local Ray ``hymt`` starts (``driver.session.start_local_ray``): where Ray's dashboard cannot start, and
beside another Ray starting at the same moment.

Each test runs its commands in subprocesses with their own Ray temp dir and no RAY_ADDRESS, so every one
starts a local Ray of its own, as on a user's machine (the test session's Ray, if one runs, stays apart).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import E2E_EVAL, FLORES_DEVTEST, REPO, tiny_overrides


@pytest.fixture
def ray_tmp():
    """A short temp dir for Ray (its socket paths have a length limit), removed after the test."""
    temp = tempfile.mkdtemp(prefix="hymt-s-", dir="/tmp")
    yield temp
    shutil.rmtree(temp, ignore_errors=True)


def _env(ray_tmp: str, *first_on_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "HYMT_VERBOSE")}
    # A dashboard that finds its port taken once it binds logs the failure but its process stays (its module
    # subprocesses keep it alive), so ray.init sees the failure only when Ray's dashboard startup timeout
    # (60 s) runs out; 20 s is still several times the ~3 s a dashboard takes to come up on this machine.
    env.update(RAY_TMPDIR=ray_tmp, PYTHONUNBUFFERED="1", RAY_DASHBOARD_STARTUP_TIMEOUT_S="20",
               PYTHONPATH=os.pathsep.join([*map(str, first_on_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return env


def _sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


# ---- a Ray whose dashboard's packages are missing ---------------------------------------------------------

NO_DASHBOARD_SCRIPT = """
import json, runpy, sys
from raytrain_hymt import cli
bench, train, tune = map(json.loads, sys.argv[1:])
print("BENCHMARK EXIT", runpy.run_path("jobs/benchmark.py")["main"](bench), flush=True)
print("TRAIN EXIT", cli.main(["train", "--name", "r", *train]), flush=True)
print("TUNE EXIT", cli.main(["tune", "--config", "tune-tiny-cpu", *tune]), flush=True)
"""


def test_without_the_dashboards_packages_ray_starts_without_it_and_runs_benchmark_training_and_evaluation(
        tmp_path, ray_tmp):
    """What stands in for a ``ray`` installed without ``[default]``: a folder first on PYTHONPATH whose
    ``aiohttp`` and ``aiohttp_cors`` packages raise ModuleNotFoundError on import, as they do where the
    packages are absent. Ray 2.60 decides whether its dashboard can start by importing
    ``ray.dashboard.optional_deps``, whose first import is aiohttp; every Ray process of the run inherits
    the path, so the dashboard's own process lacks them too. This is the real Ray, unmodified; a second
    virtualenv with ``ray`` alone would need Ray, torch, DeepSpeed and the rest installed again (no network
    here). One driver process: jobs/benchmark.py first (the command the issue saw fail, which starts the
    local Ray), then ``hymt train`` with its end-of-run evaluation and ``hymt tune`` on that Ray."""
    stub = tmp_path / "no-dashboard-packages"
    for name in ("aiohttp", "aiohttp_cors"):
        (stub / name).mkdir(parents=True)
        (stub / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    bench = ["--cpu", "--shape", "tiny", "--steps", "2", "--warmup", "1", "--workers", "2", "--out",
             str(tmp_path / "bench"), "--set", "data.pack_tokens=512", "--case", "cpu-packed"]
    train = _sets(tiny_overrides(tmp_path / "runs", **{"eval.test_set": FLORES_DEVTEST, **E2E_EVAL,
                                                        "optim.max_steps": 10}))
    tune = ["--name", "search", "--set", f"run.storage_root={tmp_path / 'runs'}"]
    out = subprocess.run([sys.executable, "-c", NO_DASHBOARD_SCRIPT, *map(json.dumps, (bench, train, tune))], cwd=REPO,
                         env=_env(ray_tmp, stub), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    # Lines about the dashboard (the temp folder's name holds the test's name, which says "dashboard" too).
    warnings = [line for line in out.stderr.splitlines() if "dashboard" in line.replace(str(tmp_path), "")]
    assert warnings[0] == (
        "Ray's dashboard cannot start, its packages are missing (No module named 'aiohttp'; pip install "
        "'ray[default]' adds them): the local Ray runs without it, so Ray Train's placement-group cleaner cannot "
        "free the workers of a run whose controller died, and hymt tune refuses to start"), out.stderr[-3000:]
    assert "BENCHMARK EXIT 0" in out.stdout and "TRAIN EXIT 0" in out.stdout, (out.stdout[-3000:], out.stderr[-3000:])
    assert '"case": "cpu-packed"' in out.stdout and '"error"' not in out.stdout, out.stdout[-3000:]
    assert re.search(r"^  BLEU/chrF:    en-zh \d+\.\d\d/\d+\.\d\d, zh-en ", out.stdout, re.M), out.stdout[-3000:]
    assert (tmp_path / "runs" / "r" / "model" / "config.json").exists()
    # hymt tune refuses before any trial, and says why: the dashboard's packages.
    assert "TUNE EXIT 2" in out.stdout, (out.stdout[-3000:], out.stderr[-3000:])
    assert ("error: hymt tune needs Ray's State API, served by the dashboard, which this cluster does not run "
            "(its packages are missing: No module named 'aiohttp'): ") in out.stderr, out.stderr[-3000:]
    # The benchmark's start warned; the runs after it joined that Ray and said nothing more about it.
    assert len(warnings) == 2, warnings  # the warning, and tune's refusal


# ---- two local Rays starting at once -------------------------------------------------------------------

PORT_RACE_SCRIPT = """
import logging, socket, threading, time
import psutil, ray
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.driver import session
logging.basicConfig(level=logging.INFO, format="%(message)s")  # as the command line logs

held = {}

def hold(port, how):
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    held[how] = (port, s)

choose = session._dashboard_port

def taken_after_the_choice():
    port = choose()
    if not held:
        hold(port, "before Ray's check")
    return port

def taken_once_the_dashboard_starts():
    me = psutil.Process()
    while "while the dashboard started" not in held:
        for p in me.children(recursive=True):
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if any(c.endswith("dashboard/dashboard.py") for c in cmd):
                port = int(next(c for c in cmd if c.startswith("--port=")).split("=")[1])
                hold(port, "while the dashboard started")
                break
        time.sleep(0.01)

session._dashboard_port = taken_after_the_choice
threading.Thread(target=taken_once_the_dashboard_starts, daemon=True).start()
assert session.init_ray(load_config(None, []))

@ray.remote(num_cpus=0)
def api_server():
    import os
    return os.environ["RAY_API_SERVER_ADDRESS"]

address = ray.get(api_server.remote())
session.check_state_api()  # this Ray's own State API answers
print("HELD", " ".join(f"{port}" for port, _ in held.values()))
print("API", address)
commands = [p.cmdline() for p in psutil.Process().children(recursive=True)]
print("GCS", sum(c[0].endswith("/gcs_server") for c in commands if c),
      "DASHBOARD", sum(any(a.endswith("dashboard/dashboard.py") for a in c) for c in commands))
"""


def test_a_dashboard_port_taken_while_ray_starts_starts_ray_again_on_another(tmp_path, ray_tmp):
    """Both ways another process can take the chosen port, forced: a listener bound right after
    ``_dashboard_port`` chose it (stands in for another Ray's dashboard binding it in that moment: Ray's
    own check then finds it taken), then, on the second start, a listener bound as soon as the dashboard's
    process appears, before that process (seconds of imports) binds it. The third start finds its port free.
    Everything else is the real Ray; only the project's own port choice is wrapped."""
    out = subprocess.run([sys.executable, "-c", PORT_RACE_SCRIPT], cwd=REPO, env=_env(ray_tmp),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    first, second = out.stdout.split("HELD ")[1].split("\n")[0].split()
    assert out.stderr.splitlines() == [
        f"Ray's dashboard port {first} was taken while Ray started (another Ray starting beside this one); "
        "starting again on another port",
        f"Ray's dashboard port {second} was taken while Ray started (another Ray starting beside this one); "
        "starting again on another port",
    ], out.stderr[-3000:]
    api = out.stdout.split("API ")[1].split("\n")[0]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", api) and api.rsplit(":", 1)[1] not in (first, second), api
    # The failed starts' GCS and the dashboard that gave up are gone: one of each is left, this Ray's.
    assert "GCS 1 DASHBOARD 1" in out.stdout, out.stdout


def test_two_hymt_commands_started_together_both_finish(tmp_path, ray_tmp):
    """Two ``hymt prepare`` at the same moment, each starting its own local Ray on this machine."""
    procs = [subprocess.Popen([sys.executable, "-m", "raytrain_hymt.cli", "prepare", str(tmp_path / f"ds{i}"),
                               "--set", f"run.storage_root={tmp_path / 'runs'}"],
                              cwd=REPO, env=_env(ray_tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        done = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, done):
        assert p.returncode == 0, (stdout[-3000:], stderr[-3000:])
        assert "prepared dataset: " in stdout
