"""`ray job submit --working-dir . -- python jobs/train.py` against a `ray start` cluster: the session's
two-node loopback cluster (``two_node_cluster``), shared with the node-loss and elastic tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from fault_tolerance_common import read_records
from ray_cluster import BIN
from test_console import assert_quiet_console

pytestmark = pytest.mark.integration


def _submit_train(url: str, env: dict, submission_id: str, name: str, storage: Path, *sets: str) -> tuple[str, str]:
    """Submit a 6-step tiny ``jobs/train.py`` run with the Ray CLI, wait for it; ``(status, job logs)``."""
    overrides = [f"run.storage_root={storage}", "optim.max_steps=6", "checkpoint.every_steps=3",
                 "eval.every_steps=3", *sets]
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", url, "--submission-id", submission_id,
         "--working-dir", ".", "--", "python", "jobs/train.py", "--name", name,
         *(arg for o in overrides for arg in ("--set", o))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    status = subprocess.run(
        [str(BIN / "python"), "-c", "import sys; from ray.job_submission import JobSubmissionClient as C; "
         "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)", url, submission_id],
        env=env, capture_output=True, text=True, timeout=60,
    )
    logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", url, submission_id],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60).stdout
    state = status.stdout.strip()
    assert state == "SUCCEEDED", f"{state}{status.stderr}\n{submit.stdout[-3000:]}\n{logs[-3000:]}"
    return state, logs


def test_train_job_submitted_with_the_ray_cli_runs_on_both_nodes(two_node_cluster, tmp_path):
    """A head and a second node (two `ray start` processes on loopback). Each training worker asks for 3
    logical CPUs: the head (5) and the other node (3) can each host one, so Ray must place them apart.
    Each rank's per-step record (``HYMT_RECORD_DIR``, brought to the workers by ``scaling.env``) names
    the node it ran on. The job's console stays quiet, and the workers export the model (sharded)."""
    storage, records, cluster = tmp_path / "runs", tmp_path / "records", two_node_cluster
    nodes = cluster.node_ids()
    _, logs = _submit_train(cluster.url, cluster.env, "hymt-e2e", "submitted", storage,
                            "scaling.cpus_per_worker=3", f"scaling.env.HYMT_RECORD_DIR={records}")
    assert "run submitted: 6 steps" in logs
    assert_quiet_console(logs, steps=6)
    assert len(nodes) == 2
    ran_on = [{r["node"] for r in read_records(records, rank)} for rank in (0, 1)]
    assert all(len(n) == 1 for n in ran_on), ran_on  # no restarts: one node per rank
    assert ran_on[0] | ran_on[1] == nodes  # both nodes, one worker each
    summary = json.loads((storage / "submitted" / "summary.json").read_text())
    assert summary["steps"] == 6
    assert Path(summary["model_dir"], "model.safetensors.index.json").exists()  # the workers' sharded export


def test_tune_job_submitted_with_the_ray_cli_succeeds(two_node_cluster, tmp_path):
    storage = tmp_path / "runs"
    submit = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", two_node_cluster.url, "--working-dir", ".", "--",
         "python", "jobs/tune.py", "--config", "tune-tiny-cpu", "--name", "submitted-search",
         "--set", f"run.storage_root={storage}", "--set", "optim.max_steps=2", "--set", "eval.every_steps=2",
         "--set", "checkpoint.every_steps=2", "--set", "tune.lr_grid=[3.0e-3]"],
        cwd=REPO, env=two_node_cluster.env, capture_output=True, text=True, timeout=600,
    )
    assert submit.returncode == 0, f"{submit.stdout[-3000:]}\n{submit.stderr[-2000:]}"
    assert "search submitted-search: 1 trial of up to 2 steps" in submit.stdout
    assert (storage / "submitted-search" / "best.yaml").exists()
