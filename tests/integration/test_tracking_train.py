"""MLflow tracking of a real training job (Ray Train, 2 CPU workers, DeepSpeed, tiny model) against a real
``mlflow server`` on loopback that is stopped mid-run and started again on the same port and database;
then the same job submitted again continues the same MLflow run; and a job that starts while the server is down."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow_server import free_port, run_mlflow_server

from conftest import tiny_overrides
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.train.faults import FAULTS_ENV
from raytrain_hymt.driver.train import run_training
from raytrain_hymt.storage import RUN_FILE

pytestmark = pytest.mark.integration

PASSWORD = "pw-TRACK-7781"  # in the tracking URI (a config value)
HF_SECRET = "hf_SECRETtoken4242"  # in the environment
STEPS, MORE_STEPS = 40, 44
LATE_STEPS = 24  # a job that starts with the server down


def _hold(step: int, until: Path) -> dict:
    """A fault that holds the run before ``step`` until the file ``until`` exists (10 minutes at most)."""
    return {"kind": "stall", "rank": 0, "step": step, "seconds": 600, "until": str(until)}


def _jsonl_steps(run_dir: Path, key: str) -> list[int]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["step"] for x in lines if x["kind"] == "metric" and x["key"] == key]


def _wait(what: str, condition, timeout_s: float = 600, thread: threading.Thread | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if thread is not None and not thread.is_alive():
            raise AssertionError(f"training ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.2)


def _mlflow_steps(url: str, run_dir: Path, key: str) -> list[int]:
    """Steps of ``key`` in the run, or [] while the run or the server is not there yet."""
    try:
        run_id = json.loads((run_dir / RUN_FILE).read_text())["mlflow_run_id"]
        return sorted(m.step for m in MlflowClient(url).get_metric_history(run_id, key))
    except Exception:  # noqa: BLE001 - polling: not there yet
        return []


def _worker_log_lines(needle: str) -> list[str]:
    """Lines containing ``needle`` in this Ray session's worker logs (the rank-0 worker logs there)."""
    import ray

    logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    found = []
    for path in glob.glob(os.path.join(logs, "worker-*")):
        with open(path, errors="replace") as f:
            found += [line for line in f if needle in line]
    return found


class _Tee(io.TextIOBase):
    """Write to the real stream and keep a copy (what the driver prints, Ray's worker lines included)."""

    def __init__(self, stream, copy: io.StringIO):
        self.stream, self.copy = stream, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@pytest.fixture(scope="module")
def outage_run(ray_session, tmp_path_factory):
    """One training job whose tracking server goes away after step 3 and comes back ~3 steps later."""
    root = tmp_path_factory.mktemp("tracked")
    db, port = root / "server" / "mlflow.db", free_port()
    url = f"http://127.0.0.1:{port}"
    overrides = tiny_overrides(root / "runs", **{
        "run.name": "tracked", "optim.max_steps": STEPS, "optim.micro_batch_size": 4,
        "eval.every_steps": 20, "checkpoint.every_steps": 20,
        "tracking.tracking_uri": f"http://alice:{PASSWORD}@127.0.0.1:{port}",
        "tracking.retry_interval_s": 1, "tracking.tensorboard": True, "tracking.log_model": True,
    })
    cfg = load_config(None, overrides)
    run_dir = Path(cfg.run.storage_path, "tracked")
    os.environ["HF_TOKEN"] = HF_SECRET
    # However slow the server's restart on a busy machine, the run waits for it before its last step.
    back = root / "server-back"
    os.environ[FAULTS_ENV] = json.dumps([_hold(STEPS, back)])
    outcome: dict = {}
    printed = io.StringIO()

    def train():
        try:
            outcome["summary"] = run_training(cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            outcome["error"] = e

    capture = contextlib.ExitStack()  # what the driver prints while training, Ray's worker lines included
    capture.enter_context(contextlib.redirect_stdout(_Tee(sys.stdout, printed)))
    capture.enter_context(contextlib.redirect_stderr(_Tee(sys.stderr, printed)))
    try:
        with run_mlflow_server(db, port):
            thread = threading.Thread(target=train, daemon=True)
            thread.start()
            _wait("step 3 in MLflow", lambda: len(_mlflow_steps(url, run_dir, "train/loss")) >= 3, thread=thread)
        stopped_at = max(_jsonl_steps(run_dir, "train/loss"))
        # Server down: training goes on, metrics go to the JSONL.
        _wait("3 steps trained during the outage",
              lambda: max(_jsonl_steps(run_dir, "train/loss")) >= stopped_at + 3, thread=thread)
        restarted_at = max(_jsonl_steps(run_dir, "train/loss"))
        with run_mlflow_server(db, port, startup_timeout_s=300):  # same port, same database
            back.touch()
            thread.join(timeout=900)
            os.environ.pop(FAULTS_ENV)
            capture.close()
            assert "error" not in outcome, outcome.get("error")
            assert restarted_at < STEPS, "training ended during the outage: make the run longer"
            yield url, cfg, run_dir, outcome["summary"], (stopped_at, restarted_at), printed.getvalue()
    finally:
        capture.close()
        os.environ.pop("HF_TOKEN", None)
        os.environ.pop(FAULTS_ENV, None)


def test_outage_loses_nothing_and_warns_once(outage_run):
    url, _, run_dir, summary, (stopped_at, restarted_at), _ = outage_run
    client = MlflowClient(url)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert stopped_at < restarted_at < STEPS
    # Every step reached MLflow exactly once, including those trained while the server was down.
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s_per_worker", "train/memory_gib"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(1, STEPS + 1)), key
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/loss")) == [20, 40]
    assert run.data.metrics["data.rows_read"] == 10390
    # The local copy has every step once: only rank 0 of the 2 workers logs.
    assert _jsonl_steps(run_dir, "train/loss") == list(range(1, STEPS + 1))
    # One warning for the outage (from the rank-0 worker), not one per step; and one when it came back.
    assert len(_worker_log_lines(f"127.0.0.1:{url.rsplit(':', 1)[1]} is unreachable")) == 1
    assert len(_worker_log_lines(f"127.0.0.1:{url.rsplit(':', 1)[1]} is reachable again")) == 1


def test_artifacts_config_deepspeed_and_model(outage_run, tmp_path):
    url, _, _, summary, _, _ = outage_run
    client = MlflowClient(url)
    top = {a.path for a in client.list_artifacts(summary.mlflow_run_id)}
    assert {"config.yaml", "deepspeed_config.json", "model"} <= top
    ds = json.loads(Path(client.download_artifacts(summary.mlflow_run_id, "deepspeed_config.json", str(tmp_path))).read_text())
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["train_micro_batch_size_per_gpu"] == 4
    model_files = {Path(a.path).name for a in client.list_artifacts(summary.mlflow_run_id, "model")}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= model_files
    assert client.get_run(summary.mlflow_run_id).data.tags["model_dir"] == summary.model_dir


def test_secrets_appear_nowhere(outage_run, tmp_path):
    url, _, run_dir, summary, _, printed = outage_run
    client = MlflowClient(url)
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.params["tracking.tracking_uri"] == f"http://alice:***@127.0.0.1:{url.rsplit(':', 1)[1]}"
    texts = [json.dumps(run.data.params), json.dumps(run.data.tags)]
    for name in ("config.yaml", "deepspeed_config.json"):
        texts.append(Path(client.download_artifacts(run.info.run_id, name, str(tmp_path))).read_text())
    texts.append((run_dir / "metrics.jsonl").read_text())
    # Nor in what the driver printed (MLflow's own "View run <URI>" line included) or the workers logged.
    texts.append(printed)
    texts += _worker_log_lines(PASSWORD) + _worker_log_lines(HF_SECRET)
    assert "is reachable again" in printed  # the capture did see the workers' lines
    for text in texts:
        assert PASSWORD not in text and HF_SECRET not in text


def test_tensorboard_event_files_from_rank_0(outage_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, _, run_dir, _, _, _ = outage_run
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1  # one writer: rank 0
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.step for e in acc.Scalars("val/loss")] == [20, 40]


def test_resubmitted_job_continues_the_same_run(outage_run):
    url, cfg, _, first, _, _ = outage_run
    again = load_config(None, [f"run.storage_root={cfg.run.storage_root}", "run.name=tracked",
                               f"optim.max_steps={MORE_STEPS}", "optim.micro_batch_size=4",
                               "eval.every_steps=20", "checkpoint.every_steps=20",
                               f"tracking.tracking_uri={cfg.tracking.tracking_uri}", "tracking.retry_interval_s=1",
                               "run.allow_config_change=true"])  # a longer schedule: resume.py stops it otherwise
    second = run_training(again)
    assert second.mlflow_run_id == first.mlflow_run_id
    client = MlflowClient(url)
    run = client.get_run(first.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id], filter_string="attributes.run_name = 'tracked'")) == 1
    # Steps 41-44 were added after the checkpoint at 40; none of 1-40 (nor data.* at step 0) twice.
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(1, MORE_STEPS + 1))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "data.rows_read")] == [0]


def test_server_down_at_start_rank0_attaches_when_it_comes_up(ray_session, tmp_path, monkeypatch):
    """The server is not there when the job starts: rank 0 still writes metrics.jsonl, creates the job's run (found
    by the key in run.json) once the server answers, and sends what it queued; the driver then joins that run."""
    db, port = tmp_path / "server" / "mlflow.db", free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = load_config(None, tiny_overrides(tmp_path / "runs", **{
        "run.name": "late", "optim.max_steps": LATE_STEPS, "optim.micro_batch_size": 4, "eval.every_steps": 12,
        "checkpoint.every_steps": 12, "tracking.tracking_uri": url, "tracking.retry_interval_s": 1,
    }))
    run_dir = Path(cfg.run.storage_path, "late")
    # The server's first start on a busy machine takes over a minute: the run waits for it before its last step.
    up = tmp_path / "server-up"
    monkeypatch.setenv(FAULTS_ENV, json.dumps([_hold(LATE_STEPS, up)]))
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(summary=run_training(cfg)), daemon=True)
    thread.start()
    # Rank 0 writes its local copy while nothing answers.
    _wait("3 steps in metrics.jsonl with the server down", lambda: (run_dir / "metrics.jsonl").exists()
          and len(_jsonl_steps(run_dir, "train/loss")) >= 3, thread=thread)
    with run_mlflow_server(db, port, startup_timeout_s=300):
        up_at = max(_jsonl_steps(run_dir, "train/loss"))
        up.touch()
        thread.join(timeout=900)
        assert "summary" in outcome, "training failed (see its log above)"
        assert up_at < LATE_STEPS, "training ended before the server came up: make the run longer"
        summary, client = outcome["summary"], MlflowClient(url)
        runs = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
        assert [r.info.run_id for r in runs] == [summary.mlflow_run_id]  # one run: rank 0's, which the driver joined
        run = client.get_run(summary.mlflow_run_id)
        assert run.info.status == "FINISHED" and run.info.run_name == "late"
        for key in ("train/loss", "train/lr", "train/grad_norm"):  # those logged before the server was up included
            assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == list(range(1, LATE_STEPS + 1)), key
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/loss")) == [12, 24]
        assert [m.step for m in client.get_metric_history(run.info.run_id, "data.rows_read")] == [0]  # the driver's
        assert run.data.params["optim.max_steps"] == str(LATE_STEPS)  # the driver's params, sent after fit
        saved = json.loads((run_dir / RUN_FILE).read_text())
        assert run.data.tags["raytrain_hymt.run_key"] == saved["mlflow_run_key"]
        assert run.data.tags["model_dir"] == summary.model_dir
        assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"config.yaml", "deepspeed_config.json"}
    assert _jsonl_steps(run_dir, "train/loss") == list(range(1, LATE_STEPS + 1))
    assert len(_worker_log_lines(f"127.0.0.1:{port} is unreachable")) == 1
    assert len(_worker_log_lines(f"127.0.0.1:{port} is reachable again")) == 1
