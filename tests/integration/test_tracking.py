"""raytrain_hymt.tracking.tracker against real MLflow stores: embedded sqlite and a real ``mlflow server``."""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import threading
import time

import pytest
from mlflow import MlflowClient
from mlflow_server import free_port, run_mlflow_server

from raytrain_hymt.tracking import tracker as tracking
from raytrain_hymt.tracking.redact import redact, redact_text
from raytrain_hymt.tracking.tracker import NullTracker, Tracker, make_tracker

SECRET = "s3cr3t-VALUE-4242"
URI_PASSWORD = "uRiPaSs-9191"


@pytest.fixture(autouse=True)
def restore_environ():
    """Tracker.start sets MLflow's HTTP env defaults; keep them out of other tests."""
    saved = dict(os.environ)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """One MLflow server shared by the tests that do not stop it."""
    root = tmp_path_factory.mktemp("mlflow_server")
    with run_mlflow_server(root / "mlflow.db", free_port()) as url:
        yield url


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _wait_for_retry(tracker: Tracker) -> None:
    """Sleep until the tracker's retry interval after its last failed try has passed."""
    time.sleep(max(0.0, tracker._next_try - time.monotonic()) + 0.05)


def _unreachable_warnings(caplog) -> int:
    return sum(
        "unreachable" in r.getMessage()
        for r in caplog.records
        if r.name == tracking.logger.name and r.levelno == logging.WARNING
    )


class _HangingProxy:
    """A TCP proxy in front of an MLflow server; while ``hang`` is set it takes requests and answers none (a hung
    store, which only a request timeout ends, unlike a stopped one, which refuses connections at once)."""

    def __init__(self, target_port: int):
        self.target_port, self.hang = target_port, threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._pipe, args=(conn,), daemon=True).start()

    def _pipe(self, conn: socket.socket) -> None:
        with conn, socket.create_connection(("127.0.0.1", self.target_port)) as upstream:
            while True:
                ready, _, _ = select.select([conn, upstream], [], [], 0.1)
                if self.hang.is_set():  # what came in is never forwarded nor answered; closed once it ends
                    while self.hang.is_set():
                        time.sleep(0.05)
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (upstream if sock is conn else conn).sendall(data)


# ---- pure functions ----------------------------------------------------------------------------------


def test_redact_keys_and_uris():
    data = {
        "hf_token": "x",
        "HF_TOKEN": "x",
        "model": {"pad_token_id": 5, "max_tokens": 7, "tokenizer": "tok", "apiKey": "x"},
        "aws": {"secret_access_key": "x", "region": "eu"},
        "db": "postgresql://alice:pw123@db:5432/mlflow",
        "lists": ["https://bob:pw456@host/x", 3],
        "auth": {"user": "u"},
    }
    out = redact(data)
    assert out["hf_token"] == out["HF_TOKEN"] == out["model"]["apiKey"] == "***"
    assert out["model"]["pad_token_id"] == 5 and out["model"]["max_tokens"] == 7
    assert out["model"]["tokenizer"] == "tok"
    assert out["aws"] == {"secret_access_key": "***", "region": "eu"}
    assert out["db"] == "postgresql://alice:***@db:5432/mlflow"
    assert out["lists"] == ["https://bob:***@host/x", 3]
    assert out["auth"] == "***"
    assert redact({"run.api_key": "x"}) == {"run.api_key": "***"}  # a dotted component

    text = 'hf_token: abc\nmax_tokens: 8\n  "password": "p",\nuri=s3://k:v@bucket\n'
    assert redact_text(text) == 'hf_token: ***\nmax_tokens: 8\n  "password": "***",\nuri=s3://k:***@bucket\n'


def test_resolve_tracking_uri_precedence(tmp_path, monkeypatch):
    assert tracking.resolve_tracking_uri("http://cfg:5000", tmp_path) == "http://cfg:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert tracking.resolve_tracking_uri(None, tmp_path) == "http://env:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert tracking.resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    with pytest.raises(ValueError, match="tracking_uri"):
        tracking.default_tracking_uri("s3://bucket/runs")


def test_http_defaults_keep_user_values(monkeypatch):
    for name in tracking.HTTP_ENV_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "17")
    tracking.set_http_defaults()
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "17"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "0"


def test_null_tracker_on_other_ranks_and_when_disabled(tmp_path):
    kwargs = dict(tracking_uri="x", experiment="e", run_name="r", run_id=None, local_dir=tmp_path)
    assert isinstance(make_tracker(False, **kwargs), NullTracker)
    tracker = make_tracker(True, enabled=False, **kwargs)
    assert isinstance(tracker, NullTracker)
    tracker.log_params({"a": 1})
    tracker.log_metrics({"loss": 1.0}, step=1)
    tracker.finish()
    assert tracker.run_id is None and not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    uri = tracking.default_tracking_uri(tmp_path)
    tracker = Tracker.start(
        tracking_uri=uri, experiment="tb", run_name="r", run_id=None, local_dir=tmp_path / "run", tensorboard=True
    )
    tracker.log_metrics({"train/loss": 1.5}, step=3)
    tracker.finish()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


# ---- embedded sqlite store ---------------------------------------------------------------------------


def test_sqlite_default_params_metrics_and_resume(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=tracking.logger.name)
    uri = tracking.resolve_tracking_uri(None, tmp_path / "storage")
    local = tmp_path / "run"
    params = {"optim": {"lr": 1e-5, "betas": [0.9, 0.95]}, "hub": {"hf_token": SECRET}, "notes": "x" * 7000}

    first = Tracker.start(
        tracking_uri=uri, experiment="exp", run_name="job", run_id=None, local_dir=local, tags={"preset": "tiny"}
    )
    run_id = first.run_id
    assert run_id and first.experiment_id
    first.log_params(params)
    for step in range(1, 6):
        first.log_metrics({"train/loss": 10.0 - step}, step=step)
    first.finish(status="FAILED")  # the attempt crashed after step 5 (its checkpoint is at step 2)

    # The restarted job resumes the same MLflow run from its step-2 checkpoint: steps 3-5 come again.
    second = Tracker.start(tracking_uri=uri, experiment="exp", run_name="job", run_id=run_id, local_dir=local)
    assert second.run_id == run_id
    second.log_params(params)  # same values: skipped silently
    second.log_params({"optim": {"lr": 2e-5}})  # changed: warning, not a crash
    for step in range(3, 8):
        second.log_metrics({"train/loss": 100.0 + step}, step=step)
    second.finish()
    second.log_metrics({"train/loss": 0.5}, step=8)  # after finish: ignored (neither MLflow nor the JSONL)

    client = MlflowClient(uri)
    runs = client.search_runs([first.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "1e-05"
    assert run.data.params["optim.betas"] == "[0.9, 0.95]"
    assert run.data.params["hub.hf_token"] == "***"
    assert len(run.data.params["notes"]) == 6000
    assert run.data.tags["preset"] == "tiny"
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6, 7]  # no duplicated steps
    assert {m.step: m.value for m in history}[5] == 5.0  # the first attempt's value is kept
    assert any("immutable" in r.getMessage() for r in caplog.records)
    # Both attempts found nothing earlier to send: no "0 metric(s) to send" line on every command's console.
    assert [r.getMessage() for r in caplog.records if "to send" in r.getMessage()] == []
    # Artifacts sit next to the DB, not in the process's cwd.
    assert run.info.artifact_uri.startswith((tmp_path / "storage" / "mlartifacts").as_uri())

    lines = _jsonl(local / "metrics.jsonl")
    assert [x["step"] for x in lines if x["kind"] == "metric"] == [1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
    assert SECRET not in (local / "metrics.jsonl").read_text()


# ---- real mlflow server ------------------------------------------------------------------------------


def test_server_logging_over_http(server_url, tmp_path):
    tracker = Tracker.start(
        tracking_uri=server_url, experiment="http", run_name="r", run_id=None, local_dir=tmp_path
    )
    tracker.log_params({"model": {"name": "tiny", "layers": 2}})
    for step in (10, 20, 30):
        tracker.log_metrics({"loss": 1.0 / step, "lr": 1e-5}, step=step)
    tracker.log_dict({"a": 1, "nested": {"b": [1, 2]}}, "config.yaml")
    # A second tracker on the same run (the rank-0 worker next to the driver): close() keeps the status.
    worker = Tracker.start(
        tracking_uri=server_url, experiment="http", run_name="r", run_id=tracker.run_id, local_dir=tmp_path / "w"
    )
    worker.log_metrics({"loss": 0.01}, step=40)
    worker.close()  # sends what it queued
    client = MlflowClient(server_url)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    tracker.finish()

    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"model.name": "tiny", "model.layers": "2"}
    assert _steps(client, tracker.run_id, "loss") == [10, 20, 30, 40]
    text = client.download_artifacts(tracker.run_id, "config.yaml", str(tmp_path))
    assert "nested" in open(text).read()


def test_secrets_never_reach_params_tags_or_artifacts(server_url, tmp_path):
    tracker = Tracker.start(
        tracking_uri=server_url,
        experiment="secrets",
        run_name="r",
        run_id=None,
        local_dir=tmp_path,
        tags={"auth_token": SECRET, "source": f"https://me:{URI_PASSWORD}@git.example/repo"},
    )
    tracker.log_params({
        "hub": {"hf_token": SECRET, "repo": "org/model"},
        "HF_API_KEY": SECRET,
        "mlflow": {"uri": f"http://admin:{URI_PASSWORD}@mlflow:5000"},
        "storage": {"credentials": {"password": SECRET}},
    })  # fmt: skip
    tracker.set_tags({"wandb_api_key": SECRET, "db_password": SECRET})
    config = {"hub": {"hf_token": SECRET}, "db": f"postgresql://u:{URI_PASSWORD}@h/db"}
    tracker.log_dict(config, "config.json")
    tracker.log_text(f"hf_token: {SECRET}\nurl: s3://key:{URI_PASSWORD}@bucket\n", "config.yaml")
    tracker.finish()

    client = MlflowClient(server_url)
    run = client.get_run(tracker.run_id)
    assert run.data.params["hub.repo"] == "org/model"
    assert run.data.params["mlflow.uri"] == "http://admin:***@mlflow:5000"
    for key, value in {**run.data.params, **run.data.tags}.items():
        assert SECRET not in value and URI_PASSWORD not in value, key
    for name in ("config.json", "config.yaml"):
        text = open(client.download_artifacts(tracker.run_id, name, str(tmp_path / "dl"))).read()
        assert SECRET not in text and URI_PASSWORD not in text and "***" in text
    local = (tmp_path / "metrics.jsonl").read_text()
    assert SECRET not in local and URI_PASSWORD not in local


def test_outage_at_start_and_mid_run(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=tracking.logger.name)
    db, port = tmp_path / "server" / "mlflow.db", free_port()
    url = f"http://127.0.0.1:{port}"
    interval = 2.0
    local = tmp_path / "run"

    def timed_log(step: int) -> float:
        began = time.monotonic()
        tracker.log_metrics({"loss": float(step)}, step=step)
        return time.monotonic() - began

    # Server down at start: the run is created lazily once it answers.
    began = time.monotonic()
    tracker = Tracker.start(
        tracking_uri=url, experiment="outage", run_name="r", run_id=None, local_dir=local, retry_interval_s=interval
    )
    assert time.monotonic() - began < 5
    assert tracker.run_id is None and tracker.offline
    assert _unreachable_warnings(caplog) == 1
    tracker.log_params({"lr": 0.1})
    assert timed_log(1) < 0.05 and timed_log(2) < 0.05  # within the retry interval: not even tried

    with run_mlflow_server(db, port):
        _wait_for_retry(tracker)
        timed_log(3)  # creates the run and replays steps 1-2
        assert tracker.run_id is not None and not tracker.offline
        run_id = tracker.run_id
        timed_log(4)
    # Server stopped mid-run: bounded delay on the first failing call, then no tries until the interval.
    assert timed_log(5) < 3
    assert tracker.offline and _unreachable_warnings(caplog) == 2  # one per outage, not one per call
    assert timed_log(6) < 0.05 and timed_log(7) < 0.05
    assert _unreachable_warnings(caplog) == 2

    with run_mlflow_server(db, port):  # same port, same DB: the same store comes back
        _wait_for_retry(tracker)
        timed_log(8)  # replays 5-7
        assert not tracker.offline
        tracker.log_metrics({"loss": 9.0}, step=9)
        tracker.finish()
        client = MlflowClient(url)
        assert _steps(client, run_id, "loss") == list(range(1, 10))
        run = client.get_run(run_id)
        assert run.data.params == {"lr": "0.1"} and run.info.status == "FINISHED"
        assert len(client.search_runs([run.info.experiment_id])) == 1

    lines = _jsonl(local / "metrics.jsonl")
    assert [x["step"] for x in lines if x["kind"] == "metric"] == list(range(1, 10))
    assert [(x["key"], x["value"]) for x in lines if x["kind"] == "param"] == [("lr", "0.1")]


def test_a_hung_store_never_holds_up_logging(tmp_path, caplog, monkeypatch):
    """Metric batches go out from the tracker's own thread: while one waits for a store that does not answer,
    log_metrics returns at once; the batch that timed out is queued again and every step arrives once."""
    caplog.set_level(logging.INFO, logger=tracking.logger.name)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with run_mlflow_server(tmp_path / "server" / "mlflow.db", free_port()) as server:
        proxy = _HangingProxy(int(server.rsplit(":", 1)[1]))
        url = f"http://127.0.0.1:{proxy.port}"
        try:
            tracker = Tracker.start(
                tracking_uri=url, experiment="hung", run_name="r", run_id=None, local_dir=tmp_path / "run",
                retry_interval_s=1.0,
            )
            tracker.log_metrics({"loss": 1.0}, step=1)
            assert not tracker.offline  # waits for the batch: it arrived

            proxy.hang.set()
            began = time.monotonic()
            for step in range(2, 6):  # step 2's batch goes out and hangs; 3-5 wait in the queue
                tracker.log_metrics({"loss": float(step)}, step=step)
            assert time.monotonic() - began < 0.5
            assert tracker.offline  # the batch in flight timed out
            assert _unreachable_warnings(caplog) == 1

            proxy.hang.clear()
            _wait_for_retry(tracker)
            tracker.log_metrics({"loss": 6.0}, step=6)  # sends 2-6
            assert not tracker.offline
            tracker.finish()
            assert _steps(MlflowClient(url), tracker.run_id, "loss") == [1, 2, 3, 4, 5, 6]
            assert _unreachable_warnings(caplog) == 1
        finally:
            proxy.close()


def _hymt(*args: str, env: dict | None = None):
    """``hymt ARGS`` in a subprocess; also says whether Ray was imported (``RAY: True/False``, last line)."""
    import subprocess
    import sys

    from conftest import REPO

    script = ("import sys\nfrom raytrain_hymt.cli import main\nrc = main(sys.argv[1:])\n"
              "print('RAY:', 'ray' in sys.modules)\nsys.exit(rc)")
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    full.pop("HYMT_VERBOSE", None)
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env=full, cwd=REPO)


def test_sync_sends_what_metrics_jsonl_holds_once(server_url, tmp_path):
    """``hymt sync`` of a run whose tracking server was down from its start to its end. A hand-written run
    folder stands in for such a run (training one costs a minute; what sync reads is only ``run.json``,
    ``metrics.jsonl``, ``config.yaml`` and ``summary.json``): its ``run.json`` has the job's key but no MLflow
    run id, its ``metrics.jsonl`` the driver's data metric at step 0, steps 1-6 of rank 0 with steps 5-6 logged
    twice (a resume after a checkpoint at 4; the first value counts, as the tracker keeps it), validation at
    3 and 6, and the params logged at the start and again at the resume. The server, back, is the module's."""
    run_dir = tmp_path / "runs" / "offline"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"mlflow_run_id": None, "mlflow_run_key": "key-offline-1",
                                                  "tracking_uri": server_url}))
    (run_dir / "config.yaml").write_text("tracking:\n  experiment: synced\n")
    (run_dir / "summary.json").write_text("{}")
    loss = {1: 8.0, 2: 7.5, 3: 7.0, 4: 6.5, 5: 6.0, 6: 5.5}
    lines = [{"kind": "param", "step": None, "key": k, "value": v, "time": 100.0}
             for k, v in (("optim.lr", "0.001"), ("optim.max_steps", "6"))]
    lines.append({"kind": "metric", "step": 0, "key": "data.rows_read", "value": 10390.0, "time": 100.0})
    attempts = [range(1, 7), range(5, 7)]  # crashed after step 6, resumed from the checkpoint at step 4
    for n, steps in enumerate(attempts):
        for step in steps:
            when = 100.0 + 10 * n + step
            lines.append({"kind": "metric", "step": step, "key": "train/loss", "value": loss[step] + n, "time": when})
            if step % 3 == 0:
                lines.append({"kind": "metric", "step": step, "key": "val/loss", "value": loss[step] + 0.25 + n,
                              "time": when})
        if n == 0:
            lines += [{**line, "value": "0.002" if line["key"] == "optim.lr" else line["value"], "time": 150.0}
                      for line in lines[:2]]  # params again at the resume (a changed lr: MLflow keeps the first)
    lines.append('{"kind": "metric", "step": 7, "key": "train/lo')  # cut off by the crash: skipped
    (run_dir / "metrics.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    storage = ["--set", f"run.storage_root={tmp_path / 'runs'}"]

    missing = _hymt("sync", "nope", *storage)
    assert (missing.returncode, missing.stderr.strip()) == (2, (
        f"error: sync: run 'nope' has no metrics.jsonl in {tmp_path / 'runs' / 'nope'} (no such run, or it logged "
        "nothing)"))

    dead = f"http://127.0.0.1:{free_port()}"
    down = _hymt("sync", "offline", *storage, "--set", f"tracking.tracking_uri={dead}")
    assert down.returncode == 2, down.stderr
    assert down.stderr.strip().splitlines() == [
        f"error: sync: the MLflow tracking server {dead} does not answer (MlflowException); nothing was sent: run "
        "hymt sync again once it does"]
    assert json.loads((run_dir / "run.json").read_text())["mlflow_run_id"] is None

    first = _hymt("sync", "offline", *storage)
    assert first.returncode == 0, first.stderr
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    assert first.stdout.splitlines() == [
        f"sync offline: sent 9 metric value(s) (steps 0-6) and 2 param(s) to MLflow run {run_id} in experiment "
        f"'synced' at {server_url}", "RAY: False"]

    def history() -> dict:
        client = MlflowClient(server_url)
        runs = client.search_runs([client.get_experiment_by_name("synced").experiment_id])
        assert [r.info.run_id for r in runs] == [run_id]
        run = runs[0]
        assert (run.info.status, run.info.run_name, run.data.tags[tracking.RUN_KEY_TAG]) == (
            "FINISHED", "offline", "key-offline-1")
        assert run.data.params == {"optim.lr": "0.001", "optim.max_steps": "6"}
        return {key: [(m.step, m.value, m.timestamp) for m in sorted(client.get_metric_history(run_id, key),
                                                                      key=lambda m: m.step)]
                for key in ("data.rows_read", "train/loss", "val/loss")}

    assert history() == {
        "data.rows_read": [(0, 10390.0, 100_000)],
        "train/loss": [(s, loss[s], (100 + s) * 1000) for s in range(1, 7)],
        "val/loss": [(3, 7.25, 103_000), (6, 5.75, 106_000)],
    }
    after_first = history()

    second = _hymt("sync", "offline", *storage)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == [
        f"sync offline: MLflow run {run_id} in experiment 'synced' at {server_url} already holds everything in "
        "metrics.jsonl; nothing sent", "RAY: False"]
    assert history() == after_first
    assert json.loads((run_dir / "run.json").read_text())["mlflow_run_id"] == run_id
