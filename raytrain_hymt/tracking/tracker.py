"""MLflow tracking for the driver and rank 0 of a training job; every other rank gets a :class:`NullTracker`.

Explicit run ids (``MlflowClient``), never ``mlflow.start_run``: Ray restarts workers, and a global run would not last.
The driver logs before and after ``fit``, rank 0 during it (never both at once, so only one creates the job's run).

A :class:`Tracker` holds what MLflow has yet to take and the outage state. It finds the run and sends params, tags
and artifacts from the caller's thread; metrics go out from its own thread, one synchronous ``log_batch`` at a time,
so that a training step never waits for the store, and each batch stays queued until MLflow took it. The functions
below it are the MLflow side: which store (URI), how long one request may take, what the store accepts (names,
lengths), which of its errors mean "try later", and which experiment and run a job logs to.

Importing this module does not import mlflow (ranks != 0 and GPU images without mlflow only need a NullTracker).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from raytrain_hymt.config.schema import flatten
from raytrain_hymt.storage import is_uri
from raytrain_hymt.tracking.metrics_log import MetricsLog, read_metrics
from raytrain_hymt.tracking.redact import redact, redact_text, redact_uri_credentials

logger = logging.getLogger(__name__)
PARENT_RUN_TAG = "mlflow.parentRunId"
Send = Callable[[Any], None]  # one synchronous MLflow call, given the client


def _short(exc: BaseException, limit: int = 300) -> str:
    text = redact_uri_credentials(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[:limit] + "..."


def param_items(params: Mapping) -> dict[str, str]:
    """Params as logged: flattened with dots, redacted, ``str()``'d and cut to MLflow's value limit."""
    return {clean_key(k): str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in redact(flatten(params)).items()}


def metric_items(metrics: Mapping[str, float], step: int) -> list[tuple[str, float, int]]:
    """``(key, value, step)`` of scalar metrics as logged."""
    return [(clean_key(k), float(v), int(step)) for k, v in metrics.items()]


class NullTracker:
    """Same interface as :class:`Tracker`, doing nothing (ranks != 0, tracking disabled)."""

    run_id = experiment_id = run_key = None

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing."""

    log_params = log_metrics = log_artifact = log_text = log_dict = set_tags = close = finish = _nothing


class LocalTracker(NullTracker):
    """Rank 0's tracker with MLflow off: metrics and params still go to ``metrics.jsonl`` (and TensorBoard when
    on), so that ``hymt plot``, the summary and the benchmarks read the run as with MLflow."""

    def __init__(self, local_dir: str | Path, tensorboard: bool = False):
        self._local = MetricsLog(Path(local_dir), tensorboard)

    def log_params(self, params: Mapping) -> None:
        """Log flattened, redacted params locally."""
        self._local.write("param", [(k, v, None) for k, v in param_items(params).items()], time.time())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step`` locally."""
        self._local.write("metric", metric_items(metrics, step), time.time())

    def finish(self, status: str | None = "FINISHED") -> None:
        """Close the files."""
        self._local.close()

    close = finish


class Tracker:
    """MLflow run of one job, tolerant of server outages; create with :meth:`start`. ``run_id``: the requested id until
    the run is found (None: none yet). ``new_measurements``: see :class:`RunContents`."""

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str, run_id: str | None, local_dir: str | Path,
                 run_key: str | None = None, tensorboard: bool = False, parent_run_id: str | None = None,
                 tags: Mapping | None = None, retry_interval_s: float = 30.0, max_pending: int = 200_000,
                 new_measurements: bool = False):
        self.tracking_uri, self.experiment, self.run_name, self.run_key = tracking_uri, experiment, run_name, run_key
        self.run_id, self.experiment_id = run_id, None
        self.retry_interval_s, self.max_pending, self.new_measurements = retry_interval_s, max_pending, new_measurements
        self._lock = threading.RLock()  # a metrics callback thread may log next to the training loop
        self._client = self._inflight = self._status = None  # _inflight: (Future, metrics) of the batch out
        self._sender: ThreadPoolExecutor | None = None  # the thread that sends metric batches, started with the first
        self._attached = self._offline = self._closed = False
        self._next_try = 0.0  # while offline, MLflow is not tried before this
        self._metrics: list = []  # mlflow.entities.Metric (original timestamps) that MLflow has yet to take
        self._run_has = RunContents()  # what the run holds, known once it is found
        self._local = MetricsLog(Path(local_dir), tensorboard)
        self._history_end = 0 if new_measurements else self._local.size_at_open  # earlier attempts' lines: replayed
        run_tags = {**(tags or {}), **{k: v for k, v in ((PARENT_RUN_TAG, parent_run_id), (RUN_KEY_TAG, run_key)) if v}}
        self._calls: list[tuple[str, Send]] = [self._tags_call(run_tags)]  # params, tags, artifacts: in order
        set_http_defaults()  # before the client exists, so that its first request is already bounded
        self._sync(force=True, at_start=True)

    @classmethod
    def start(cls, *, enabled: bool = True, **kwargs: Any) -> Tracker | NullTracker:
        """Open (create, or resume by ``run_id``/``run_key``) an MLflow run; a NullTracker if disabled. An unreachable
        server is not an error; misconfiguration (a bad experiment name, URI scheme) raises here, not hours later."""
        return cls(**kwargs) if enabled else NullTracker()

    @property
    def offline(self) -> bool:
        """True while the tracking server is considered unreachable (after the batch in flight, which may decide it)."""
        with self._lock:
            self._settle_inflight()
            return self._offline

    def log_params(self, params: Mapping) -> None:
        """Log (nested) params: flattened with dots, redacted, ``str()``'d and cut to 6000 characters. A param the
        run has is skipped: silently with the same value (a resumed run), else with a warning (they are immutable)."""
        items = param_items(params)
        with self._lock:
            self._local.write("param", [(k, v, None) for k, v in items.items()], time.time())
            self._queue("params", lambda client: self._send_params(items, client))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step`` (MLflow, the local JSONL, and TensorBoard when on)."""
        from mlflow.entities import Metric

        now, items = time.time(), metric_items(metrics, step)
        with self._lock:
            self._local.write("metric", items, now)
            new = [Metric(k, v, int(now * 1000), s) for k, v, s in items]
            self._metrics += self._run_has.admit(new) if self._attached else new  # filtered when the run is found
            if len(self._metrics) > self.max_pending:  # a very long outage: the oldest stay only in metrics.jsonl
                if len(self._metrics) - len(new) <= self.max_pending:  # warned once, as the queue fills up
                    logger.warning("More than %d metrics queued for MLflow: the oldest are dropped from the queue (not "
                                   "from %s)", self.max_pending, self._local.path)
                del self._metrics[: -self.max_pending]
            self._sync()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or folder; while the server is down it is queued (by path: keep the file)."""
        upload = "log_artifacts" if Path(path).is_dir() else "log_artifact"
        self._queue(f"artifact {path}", lambda client: getattr(client, upload)(self.run_id, str(path), artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` (redacted: URI passwords, ``secret: value`` lines) as ``artifact_file``."""
        clean = redact_text(text)
        self._queue(f"text artifact {artifact_file}", lambda client: client.log_text(self.run_id, clean, artifact_file))

    def log_dict(self, data: Mapping, artifact_file: str) -> None:
        """Store a redacted dict as JSON (valid YAML too, for a ``.yaml`` name)."""
        self.log_text(json.dumps(redact(data), indent=2, default=str), artifact_file)

    def set_tags(self, tags: Mapping) -> None:
        """Set run tags (redacted, values cut to 8000 characters); tags may change, unlike params."""
        self._queue(*self._tags_call(tags))

    def close(self) -> None:
        """:meth:`finish` leaving the run's status alone: rank 0's tracker, whose run the driver finishes."""
        self.finish(status=None)

    def finish(self, status: str | None = "FINISHED") -> None:
        """Send what is queued (one forced try), mark the run ``FINISHED``/``FAILED``, close the files."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._status = True, status
            self._sync(force=True, drain=True)
            self._settle_inflight()  # a batch still out when _sync stopped at an outage: queued again, counted below
            if self._sender is not None:
                self._sender.shutdown()
            if self._metrics or self._calls or self._status:
                logger.warning("MLflow run %s could not be updated at the end (server unreachable); %d metric(s) are "
                               "only in %s", self.run_id or "(never created)", len(self._metrics), self._local.path)
            self._local.close()

    def _queue(self, what: str, send: Send) -> None:
        with self._lock:
            self._calls.append((what, send))
            self._sync()

    def _tags_call(self, tags: Mapping) -> tuple[str, Send]:
        from mlflow.entities import RunTag
        clean = [RunTag(clean_key(k), str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in redact(dict(tags)).items()]
        return "tags", lambda client: client.log_batch(self.run_id, tags=clean, synchronous=True)

    def _send_params(self, params: dict[str, str], client) -> None:
        from mlflow.entities import Param
        known = self._run_has.params
        for key in (k for k, v in params.items() if known.get(k, v) != v):
            logger.warning("Param %r is already %r in MLflow run %s; not changed to %r (MLflow params are immutable; "
                           "the new value is in %s)", key, known[key], self.run_id, params[key], self._local.path)
        new = {k: v for k, v in params.items() if k not in known}
        # Sent 100 a request by MLflow; synchronous=True even if $MLFLOW_ENABLE_ASYNC_LOGGING is set, as an async
        # call's failure would never reach _settle.
        client.log_batch(self.run_id, params=[Param(k, v) for k, v in new.items()], synchronous=True)
        known.update(new)

    def _sync(self, force: bool = False, at_start: bool = False, drain: bool = False) -> None:
        """Find or create the run, send what is queued (``drain``: until all is); never raises on an outage. While
        offline MLflow is tried at most every ``retry_interval_s`` (unless ``force``): one bounded timeout at most."""
        if (self._closed and not drain) or (self._offline and not force and time.monotonic() < self._next_try):
            return
        try:
            self._attach()
            while self._calls:
                self._call(*self._calls[0])
                self._calls.pop(0)
            self._harvest(wait=drain)
            while self._metrics and self._inflight is None:
                batch, self._metrics = self._metrics[:MAX_METRICS_PER_BATCH], self._metrics[MAX_METRICS_PER_BATCH:]
                self._inflight = (self._send_metrics(batch), batch)
                self._harvest(wait=drain)
            if self._status and self._inflight is None:
                self._call("run status", lambda client: client.set_terminated(self.run_id, self._status))
                self._status = None
        except Exception as exc:  # an outage; or a refused run (_settle swallows refused data), tried again later
            if at_start and not is_outage(exc):
                raise
            self._go_offline(exc)

    def _send_metrics(self, batch: list) -> Future:
        """Hand ``batch`` to the tracker's sender thread: training goes on while the request takes its time."""
        if self._sender is None:
            self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlflow-metrics")
        return self._sender.submit(self._client.log_batch, self.run_id, metrics=batch, synchronous=True)

    def _harvest(self, wait: bool) -> None:
        """Settle the batch in flight once it is done (``wait``: wait for it); after an outage it is queued again."""
        if self._inflight is None:
            return
        future, batch = self._inflight
        if wait or future.done():
            self._inflight = None
            exc = future.exception()  # blocks until the request ended: answered, refused or timed out
            self._metrics[:0] = batch if exc is not None and is_outage(exc) else []
            self._settle("metrics", exc)

    def _settle_inflight(self) -> None:
        """Wait for the batch in flight and settle it; an outage it ends in makes the tracker offline."""
        try:
            self._harvest(wait=True)
        except Exception as exc:  # _settle lets only outages through
            self._go_offline(exc)

    def _call(self, what: str, send: Send) -> None:
        try:
            send(self._client)
        except Exception as exc:
            return self._settle(what, exc)
        self._settle(what, None)

    def _settle(self, what: str, exc: BaseException | None) -> None:
        """An outage is raised, a refusal logged (metrics.jsonl has the data), a success ends an outage."""
        if exc is not None and is_outage(exc):
            raise exc
        if exc is not None:
            return logger.warning("MLflow rejected %s (%s); kept only in %s", what, _short(exc), self._local.path)
        if self._offline:
            logger.warning("MLflow tracking server %s is reachable again; sending %d queued metric(s) to run %s",
                           redact_uri_credentials(self.tracking_uri), len(self._metrics), self.run_id)
        self._offline = False

    def _go_offline(self, exc: BaseException) -> None:
        self._next_try = time.monotonic() + self.retry_interval_s
        if not self._offline:
            self._offline = True
            logger.warning("MLflow tracking server %s is unreachable (%s); all is in %s and queued, tried again at "
                           "most every %g s", redact_uri_credentials(self.tracking_uri), _short(exc), self._local.path,
                           self.retry_interval_s)

    def _attach(self) -> None:
        """Find or create the job's run, once: learn its params and last metric steps, so that nothing is logged twice,
        and queue in front what earlier attempts wrote to ``metrics.jsonl`` and the run lacks."""
        if self._attached:
            return
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        client = self._client = self._client or MlflowClient(tracking_uri=self.tracking_uri)
        run = find_or_create_run(client, self.tracking_uri, self.experiment, self.run_name, self.run_id, self.run_key)
        self._run_has = RunContents(client, run, every_step=self.new_measurements)
        history = [Metric(k, v, int(t * 1000), s) for k, v, s, t in read_metrics(self._local.path, self._history_end)]
        self._metrics = self._run_has.admit(history + self._metrics)
        self.run_id, self.experiment_id, self._attached = run.info.run_id, run.info.experiment_id, True
        if self._metrics:  # earlier attempts' metrics the run lacks; nothing worth a line otherwise
            logger.info("MLflow run %s of %r: %d metric(s) to send", self.run_id, self.experiment, len(self._metrics))
        self._settle("the run", None)  # it answered


def make_tracker(is_rank0: bool, **kwargs: Any) -> Tracker | NullTracker:
    """:meth:`Tracker.start` on rank 0 with tracking enabled; a :class:`NullTracker` everywhere else."""
    return Tracker.start(**kwargs) if is_rank0 and kwargs.get("enabled", True) else NullTracker()


# MLflow's limits (mlflow.utils.validation, 3.17).
MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH, MAX_KEY_LENGTH, MAX_METRICS_PER_BATCH = 6000, 8000, 250, 1000
RUN_KEY_TAG = "raytrain_hymt.run_key"
"""Tag with the job's key (kept in ``run.json``): the driver and rank 0 find the job's run by it when its id is
not known yet (the server was down when the job started)."""

# Bounded delay per MLflow HTTP call (names checked in mlflow/environment_variables.py, 3.17.2). MLflow's
# defaults (7 retries with exponential backoff, 120 s timeout) would block a training step for minutes
# when the server is down; the tracker's own queue + retry interval replaces MLflow's retries.
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",  # an int in MLflow
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    # MLflow prints "View run ... at: <tracking URI>" when a run ends: with the URI's password in it.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


def default_tracking_uri(storage_root: str | Path) -> str:
    """``sqlite:///<storage_root>/mlflow.db`` (the ``./mlruns`` file store is refused by MLflow 3.17)."""
    root = str(storage_root)
    if is_uri(root):
        raise ValueError(
            f"storage_root {root!r} is a URI; an embedded sqlite MLflow store needs a local or shared "
            "filesystem path. Set tracking.tracking_uri (or $MLFLOW_TRACKING_URI) to an MLflow server."
        )
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / 'mlflow.db'}"


def resolve_tracking_uri(configured: str | None, storage_root: str | Path) -> str:
    """Tracking URI by precedence: ``configured``, then ``$MLFLOW_TRACKING_URI``, then the sqlite default."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(storage_root)


def set_http_defaults() -> None:
    """Turn MLflow's HTTP retries/timeouts down to a bounded delay, keeping values the user already set."""
    for name, value in HTTP_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


def clean_key(key: str) -> str:
    """Make ``key`` a valid MLflow param/metric/tag name (allowed characters, no path tricks, <= 250)."""
    key = re.sub(r"[^/\w.\- :]", "_", str(key))
    # MLflow refuses names that normalise to another path ("a//b", "/a", "a/../b").
    return ("/".join(part for part in key.split("/") if part not in ("", ".", "..")) or "_")[:MAX_KEY_LENGTH]


def is_outage(exc: BaseException) -> bool:
    """True for "store unreachable / failing for now" (retry later); False for what it would refuse forever (a
    rejected value, a bug, an artifact file gone): that is logged and dropped from MLflow (the JSONL keeps it)."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):  # 401/403 (credentials), 408 (timeout), 429 (rate limit) may heal
        return not (400 <= exc.get_http_status_code() < 500) or exc.get_http_status_code() in (401, 403, 408, 429)
    if isinstance(exc, OSError):  # requests' errors are OSErrors too
        return not isinstance(exc, FileNotFoundError)
    return type(exc).__module__.split(".")[0] in ("sqlalchemy", "sqlite3")  # without importing those here


def find_or_create_run(client, tracking_uri: str, experiment: str, run_name: str, run_id: str | None,
                       run_key: str | None):
    """The job's run: ``run_id``, else the run tagged with ``run_key``, else a new one (tagged); status RUNNING.

    The experiment is created if missing, with its artifacts next to an embedded sqlite DB (MLflow's default is
    ``./mlruns`` under the process's cwd, a Ray worker's temporary folder; a server decides for itself).
    """
    run = None
    if run_id:
        try:
            run = client.get_run(run_id)
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                raise
            logger.warning("MLflow run %s to resume does not exist in %s; another run takes its place", run_id,
                           redact_uri_credentials(tracking_uri))
    if run is None:
        found = client.get_experiment_by_name(experiment)
        sqlite = tracking_uri.startswith("sqlite:///")
        location = (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").as_uri() if sqlite else None
        try:
            experiment_id = found.experiment_id if found else client.create_experiment(experiment, location)
        except Exception as exc:  # another job created it between the two calls
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
            experiment_id = client.get_experiment_by_name(experiment).experiment_id
        runs = client.search_runs([experiment_id], f"tags.`{RUN_KEY_TAG}` = '{run_key}'") if run_key else []
        tags = {RUN_KEY_TAG: run_key} if run_key else None
        run = runs[0] if runs else client.create_run(experiment_id, run_name=run_name, tags=tags)
    if run.info.status != "RUNNING":
        client.update_run(run.info.run_id, status="RUNNING")
    return run


class RunContents:
    """What a run holds: its params, and each metric key's last step. A resumed job repeats the steps since its last
    checkpoint, and a second point per step would make the history zigzag: :meth:`admit` keeps only later steps
    (the first value stays), unless ``every_step`` (a re-evaluation adds new scores at the run's last step)."""

    def __init__(self, client=None, run=None, every_step: bool = False):
        self.params: dict[str, str] = dict(run.data.params) if run else {}
        self.every_step = every_step
        # run.data.metrics has each key's latest value but not its step: one history request per key the run has.
        self.last_step = {} if run is None or every_step else {
            key: max((m.step for m in client.get_metric_history(run.info.run_id, key)), default=-1)
            for key in run.data.metrics
        }

    def admit(self, metrics: list) -> list:
        """The metrics (``mlflow.entities.Metric``, in logging order) at steps the run does not have; they count as
        had from now on."""
        fresh = []
        for m in metrics:
            if self.every_step or m.step > self.last_step.get(m.key, -1):
                self.last_step[m.key] = m.step
                fresh.append(m)
        return fresh
