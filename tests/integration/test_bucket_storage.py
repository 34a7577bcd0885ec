"""``run.storage_root=s3://...`` end to end: train, checkpoint (uploaded asynchronously), a worker killed,
resume from the bucket, export, evaluate — against moto's S3 server on loopback.

moto's server mode stands in for a cloud bucket: it speaks the S3 HTTP API, and pyarrow's real S3 client
(the one Ray Train and the run folder use) reaches it through ``AWS_ENDPOINT_URL``. The endpoint and the
(dummy) credentials reach the driver and every worker and evaluation replica only through ``scaling.env``:
the job runs as its own ``python jobs/train.py`` process, which starts its own local Ray, with no AWS
variable in its environment (the test session's shared Ray was started without them, and Ray Train's
controller inherits its Ray's environment, so the job cannot share that Ray). With a bucket the runs'
MLflow data go to a real ``mlflow server`` (tests/mlflow_server.py), as the project requires.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import E2E_EVAL, FLORES_DEVTEST, REPO
from fault_tolerance_common import attempts, read_records
from mlflow_server import free_port, run_mlflow_server

pytestmark = pytest.mark.integration

BUCKET = "hymt-bucket-test"
KILL_STEP = 5  # rank 1 SIGKILLs itself before this step; checkpoints every 2 steps
STEPS = 8
#: What reaches the job only through scaling.env.
S3_VARIABLES = {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}


@pytest.fixture()
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 with one empty bucket; yields its URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per S3 request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _client(url).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        server.stop()


def _client(url: str):
    import boto3

    return boto3.client("s3", endpoint_url=url, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


def _download(url: str, prefix: str, dest: Path) -> list[str]:
    """Copy every object under ``prefix`` into ``dest``; the relative names."""
    client, names = _client(url), []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):].lstrip("/")
            if not rel or rel.endswith("/"):  # pyarrow's directory markers
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(BUCKET, obj["Key"], str(dest / rel))
            names.append(rel)
    return sorted(names)


def test_bucket_run_trains_resumes_after_a_kill_exports_and_evaluates(s3_endpoint, tmp_path):
    from mlflow import MlflowClient
    from transformers import AutoModelForCausalLM

    import raytrain_hymt.storage as run_storage

    name = f"bucket-{uuid.uuid4().hex[:8]}"
    records = tmp_path / "records"
    env = {k: v for k, v in os.environ.items() if k not in S3_VARIABLES}
    env.update(HYMT_RECORD_DIR=str(records), HYMT_FAULTS=json.dumps(
        [{"kind": "sigkill", "rank": 1, "step": KILL_STEP, "once": str(tmp_path / "killed")}]))
    secret = "moto-secret-4711"
    s3_env = {"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": secret,
              "AWS_DEFAULT_REGION": "us-east-1"}
    settings = {
        "run.storage_root": f"s3://{BUCKET}/runs", "optim.max_steps": STEPS, "checkpoint.every_steps": 2,
        "data.pack_tokens": 256,  # as conftest.tiny_overrides: a fifth of the preset's step time
        "checkpoint.async_upload": True, "checkpoint.max_failures": 1, "eval.every_steps": 4,
        "eval.test_set": FLORES_DEVTEST, **E2E_EVAL,
        **{f"scaling.env.{k}": v for k, v in s3_env.items()},
    }
    try:
        with run_mlflow_server(tmp_path / "mlflow" / "mlflow.db", free_port()) as mlflow_url:
            settings["tracking.tracking_uri"] = mlflow_url
            argv = [sys.executable, "jobs/train.py", "--name", name]
            for key, value in settings.items():
                argv += ["--set", f"{key}={value}"]
            with open(tmp_path / "job.log", "w") as log:
                job = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600)
            assert job.returncode == 0, (tmp_path / "job.log").read_text()[-8000:]
            params = MlflowClient(mlflow_url).get_run(
                json.loads(_client(s3_endpoint).get_object(Bucket=BUCKET, Key=f"runs/{name}/summary.json")["Body"].read())
                ["mlflow_run_id"]).data.params
    finally:
        import shutil

        shutil.rmtree(run_storage.STAGING_ROOT / name, ignore_errors=True)  # the driver's local copies

    run = tmp_path / "bucket"
    files = _download(s3_endpoint, f"runs/{name}", run)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["run_dir"] == f"s3://{BUCKET}/runs/{name}"
    assert summary["model_dir"] == f"s3://{BUCKET}/runs/{name}/model"
    assert set(summary["test_scores"]["scores"]) == {"en-zh", "zh-en"}  # the replicas read the model from the bucket
    # The evaluation history: one folder per evaluation (its scores.json) and one history.jsonl.
    assert "eval/devtest/history.jsonl" in files
    assert [f for f in files if f.startswith("eval/devtest/") and f.endswith("/scores.json")]
    checkpoints = {f.split("/")[0] for f in files if f.startswith("checkpoint_step")}
    assert f"checkpoint_step{STEPS:08d}" in checkpoints
    model = AutoModelForCausalLM.from_pretrained(run / "model")  # a loadable Hugging Face folder
    assert model.config.model_type == "hunyuan_v1_dense"

    # Rank 1 died before step 5; the new worker group resumed from a checkpoint in the bucket (step 2 or 4,
    # whichever upload had finished: uploads run in the background) instead of starting over.
    first, second = attempts(read_records(records, 1))
    assert first[-1]["step"] == KILL_STEP - 1
    resumed_at = second[0]["step"] - 1
    assert resumed_at in (2, 4), resumed_at
    assert [r["step"] for r in second] == list(range(resumed_at + 1, STEPS + 1))

    assert params["scaling.env.AWS_SECRET_ACCESS_KEY"] == "***" and params["scaling.env.AWS_ENDPOINT_URL"] == s3_endpoint
    assert secret not in (run / "summary.json").read_text()


def test_evaluation_replicas_get_scaling_env_from_their_runtime_env(finished_run, s3_endpoint):
    """The session's Ray (and this process) has no AWS variable: only the replicas' runtime environment,
    built from ``scaling.env``, lets them copy the model from the bucket."""
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.driver.evaluate import translate

    _, summary = finished_run
    client = _client(s3_endpoint)
    for path in Path(summary.model_dir).iterdir():
        client.upload_file(str(path), BUCKET, f"model/{path.name}")
    assert not S3_VARIABLES & set(os.environ)
    cfg = load_config(None, ["eval.workers=1", "eval.max_new_tokens=4", f"scaling.env.AWS_ENDPOINT_URL={s3_endpoint}",
                             "scaling.env.AWS_ACCESS_KEY_ID=testing", "scaling.env.AWS_SECRET_ACCESS_KEY=testing",
                             "scaling.env.AWS_DEFAULT_REGION=us-east-1"])
    rows = [{"id": 0, "src": "Hello.", "src_lang": "en", "tgt_lang": "zh"},
            {"id": 1, "src": "你好。", "src_lang": "zh", "tgt_lang": "en"}]
    hyps, errors = translate(rows, cfg, f"s3://{BUCKET}/model")
    assert len(hyps) == 2 and all(isinstance(h, str) for h in hyps)
    assert errors == ["", ""]
