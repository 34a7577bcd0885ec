"""``sbatch jobs/slurm/train.sbatch`` on a real one-machine Slurm cluster (munged, slurmctld, slurmd; see
tests/slurm_cluster.py): the tiny CPU preset trains to a finished run folder.

A one-node Slurm cannot show multi-node placement: the script's ``srun ... ray start --address`` steps for
further nodes do not run here (tests/integration/test_job_submit.py covers two Ray nodes; ``--dry-run`` below shows the
commands a two-node allocation gets). The job's Ray has its own temp dir and ports and is stopped through
its own srun step, so it runs beside the test session's Ray; the test checks that its Ray is gone after.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO
from ray_cluster import BIN, CLEANER_DIED
from slurm_cluster import missing, slurm_cluster

pytestmark = pytest.mark.integration
SCRIPT = REPO / "jobs" / "slurm" / "train.sbatch"


def test_dry_run_prints_a_ray_node_per_allocated_node_and_no_ray_stop():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--name", "x"], env=env, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("srun --nodes=1 --ntasks=1 -w node1 env RAY_API_SERVER_ADDRESS=http://127.0.0.1:20001 "
                               "ray start --head --node-ip-address=HEAD_IP --port=20000 ")
    assert "--dashboard-port=20001" in lines[0]
    assert "--temp-dir=/tmp/hymt-ray-0" in lines[0] and "--dashboard-host=127.0.0.1" in lines[0]
    assert [ln for ln in lines if "-w node2 ray start --address=HEAD_IP:20000 --block" in ln]
    assert lines[-1] == "RAY_ADDRESS=HEAD_IP:20000 python jobs/train.py --name x"
    assert "ray stop" not in out and "ray stop" not in SCRIPT.read_text().replace("Never `ray stop`", "")


def _state(env: dict, job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job, "-o"], env=env, capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)
    return fields.get("JobState", "GONE")


def test_sbatch_trains_the_tiny_preset_to_a_finished_run(ray_session, tmp_path):
    """The job's own Ray beside another one on the node (the test session's, ``ray_session``)."""
    if reason := missing():
        pytest.skip(reason)
    storage = tmp_path / "runs"
    root = Path(tempfile.mkdtemp(prefix="hymt-slurm-", dir="/tmp"))  # short: munge's socket path
    log = tmp_path / "job.log"
    with slurm_cluster(root) as env:
        env["PATH"] = f"{BIN}:{env['PATH']}"  # the job's `python` and `ray`
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={REPO}", f"--output={log}", str(SCRIPT),
             "--name", "slurm", "--set", f"run.storage_root={storage}", "--set", "optim.max_steps=4",
             "--set", "checkpoint.every_steps=2", "--set", "eval.every_steps=2"],
            env=env, capture_output=True, text=True, timeout=60, check=True)
        job = submitted.stdout.strip().split(";")[0]
        deadline = time.time() + 600
        while (state := _state(env, job)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            assert time.time() < deadline, f"job {job} still {state}:\n{log.read_text()[-3000:]}"
            time.sleep(2)
    text = log.read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text[-5000:]}"
    assert "run slurm: 4 steps" in text
    summary = json.loads((storage / "slurm" / "summary.json").read_text())
    assert summary["steps"] == 4 and Path(summary["model_dir"], "model.safetensors.index.json").exists()
    # Ray Train's placement-group cleaner watched the run: the test session's own Ray on this machine stands
    # in for another job's on a shared node, which made its State API client refuse to choose and die.
    logs = [f.read_text() for f in Path(f"/tmp/hymt-ray-{job}/session_latest/logs").glob("worker-*.err")]
    cleaner = [t for t in logs if ":actor_name:PlacementGroupCleaner" in t]
    assert cleaner and not [t for t in cleaner if CLEANER_DIED in t], cleaner
    # Its Ray ended with it: nothing is left running from the job's temp dir.
    ps = subprocess.run(["pgrep", "-f", f"/tmp/hymt-ray-{job}(/| |$)"], capture_output=True, text=True)
    assert ps.stdout.strip() == "", f"processes of the job's Ray still run: {ps.stdout}"
