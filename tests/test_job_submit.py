"""`ray job submit --working-dir . -- python jobs/train.py` against a `ray start --head` cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from ray_cluster import BIN, ray_head
from test_console import assert_quiet_console

pytestmark = pytest.mark.integration


def test_train_job_submitted_with_the_ray_cli_succeeds(tmp_path):
    storage = tmp_path / "runs"
    with ray_head() as (url, env):
        submit = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", url, "--submission-id", "hymt-e2e",
             "--working-dir", ".", "--", "python", "jobs/train.py", "--name", "submitted",
             "--set", f"run.storage_root={storage}", "--set", "optim.max_steps=6",
             "--set", "checkpoint.every_steps=3", "--set", "eval.every_steps=3"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )
        status = subprocess.run(
            [str(BIN / "python"), "-c", "import sys; from ray.job_submission import JobSubmissionClient as C; "
             "print(C(sys.argv[1]).get_job_status('hymt-e2e').value)", url],
            env=env, capture_output=True, text=True, timeout=60,
        )
        logs = subprocess.run([str(BIN / "ray"), "job", "logs", "--address", url, "hymt-e2e"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60).stdout
    assert status.stdout.strip() == "SUCCEEDED", f"{status.stdout}{status.stderr}\n{submit.stdout[-3000:]}"
    assert "run submitted: 6 steps" in logs
    assert_quiet_console(logs, steps=6)
    summary = json.loads((storage / "submitted" / "summary.json").read_text())
    assert summary["steps"] == 6
    assert Path(summary["model_dir"], "model.safetensors").exists()


def test_tune_job_submitted_with_the_ray_cli_succeeds(tmp_path):
    storage = tmp_path / "runs"
    with ray_head() as (url, env):
        submit = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", url, "--working-dir", ".", "--",
             "python", "jobs/tune.py", "--config", "tune-tiny-cpu", "--name", "submitted-search",
             "--set", f"run.storage_root={storage}", "--set", "optim.max_steps=2", "--set", "eval.every_steps=2",
             "--set", "checkpoint.every_steps=2", "--set", "tune.lr_grid=[3.0e-3]"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )
    assert submit.returncode == 0, f"{submit.stdout[-3000:]}\n{submit.stderr[-2000:]}"
    assert "search submitted-search: 1 trial of up to 2 steps" in submit.stdout
    assert (storage / "submitted-search" / "best.yaml").exists()
