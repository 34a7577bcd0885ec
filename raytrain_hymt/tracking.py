"""MLflow tracking for rank 0 of a training job; every other rank gets a :class:`NullTracker`.

Design points (why, not what):

* ``mlflow.MlflowClient`` with explicit run ids, never ``mlflow.start_run``: the code runs inside Ray
  workers that may be restarted, and a global "active run" would not survive that. A restarted job passes
  the previous ``run_id`` and continues the same MLflow run.
* A tracking-server outage must never stop or slow down training. Every MLflow call goes through one
  guarded path (:meth:`Tracker._sync`): HTTP retries are turned down to a bounded delay per call, a
  failure logs ONE warning, and afterwards MLflow is tried at most every ``retry_interval_s`` seconds.
  Everything is queued and sent (batched) once the server answers again, so the run has no gaps.
* Every metric and param is also appended to ``<local_dir>/metrics.jsonl``, whatever MLflow does.
* Secrets are redacted (:func:`redact`) before anything reaches MLflow or the local file.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from raytrain_hymt.config import flatten
from typing import Any

logger = logging.getLogger(__name__)

# MLflow's own limits (mlflow.utils.validation, 3.17); repeated here so that importing this module does
# not import mlflow (ranks != 0 and GPU images without mlflow only need NullTracker).
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_KEY_LENGTH = 250
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100

PARENT_RUN_TAG = "mlflow.parentRunId"
REDACTED = "***"

# Bounded delay per MLflow HTTP call (names checked in mlflow/environment_variables.py, 3.17.2). MLflow's
# defaults (7 retries with exponential backoff, 120 s timeout) would block a training step for minutes
# when the server is down; our own queue + retry interval replaces MLflow's retries.
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",  # an int in MLflow
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0",
    # MLflow prints "View run ... at: <tracking URI>" when a run ends: with the URI's password in it.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
}


# --------------------------------------------------------------------------------------------------
# Tracking URI
# --------------------------------------------------------------------------------------------------


def default_tracking_uri(storage_root: str | Path) -> str:
    """``sqlite:///<storage_root>/mlflow.db`` (the ``./mlruns`` file store is refused by MLflow 3.17)."""
    root = str(storage_root)
    if "://" in root:
        raise ValueError(
            f"storage_root {root!r} is a URI; an embedded sqlite MLflow store needs a local or shared "
            "filesystem path. Set tracking.tracking_uri (or $MLFLOW_TRACKING_URI) to an MLflow server."
        )
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{path / 'mlflow.db'}"


def resolve_tracking_uri(configured: str | None, storage_root: str | Path) -> str:
    """Tracking URI by precedence: ``configured``, then ``$MLFLOW_TRACKING_URI``, then the sqlite default."""
    if configured:
        return configured
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return default_tracking_uri(storage_root)


def set_http_defaults() -> None:
    """Turn MLflow's HTTP retries/timeouts down to a bounded delay, keeping values the user already set."""
    for name, value in HTTP_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)


# --------------------------------------------------------------------------------------------------
# Secrets
# --------------------------------------------------------------------------------------------------

_SECRET_WORDS = (
    "token", "password", "passwd", "secret", "api_key", "apikey", "access_key", "credential",
    "credentials", "auth", "authorization", "private_key",
)  # fmt: skip
# Whole words only: `hf_token` is a secret, `max_tokens` / `tokenizer` are not.
_SECRET_KEY_RE = re.compile(r"(?:^|_)(?:" + "|".join(_SECRET_WORDS) + r")(?:_|$)")
# `pad_token_id`, `eos_token_ids`: numbers, not secrets.
_ID_SUFFIX_RE = re.compile(r"_ids?$")
_URI_CREDENTIALS_RE = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]+):([^@\s/]+)@")
_TEXT_ASSIGNMENT_RE = re.compile(
    r"""^(?P<head>\s*(?:-\s+)?["']?(?P<key>[\w.\-]+)["']?\s*[:=]\s*)(?P<value>.+?)(?P<tail>\s*,?\s*)$""",
    re.MULTILINE,
)


def _words(component: str) -> str:
    """``hfToken`` / ``HF-Token`` / ``hf token`` -> ``hf_token`` (so that word matching is uniform)."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", component).lower()
    return re.sub(r"[^a-z0-9]+", "_", snake).strip("_")


def is_secret_key(key: Any) -> bool:
    """True when any dotted component of ``key`` names a secret (token, password, api_key, ...)."""
    for component in str(key).split("."):
        words = _words(component)
        if _ID_SUFFIX_RE.search(words):
            continue
        if _SECRET_KEY_RE.search(words):
            return True
    return False


def redact_uri_credentials(text: str) -> str:
    """``scheme://user:pass@host`` -> ``scheme://user:***@host`` anywhere in ``text``."""
    return _URI_CREDENTIALS_RE.sub(rf"\1:{REDACTED}@", text)


def redact(obj: Any) -> Any:
    """Copy of ``obj`` (nested dicts/lists) with secret-named keys' values and URI passwords replaced."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_key(k) else redact(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v) for v in obj)
    if isinstance(obj, str):
        return redact_uri_credentials(obj)
    return obj


def redact_text(text: str) -> str:
    """Redact free text (YAML/JSON/INI dumps, logs): URI passwords and ``secret_key: value`` lines."""

    def _line(match: re.Match) -> str:
        if not is_secret_key(match["key"]):
            return match[0]
        quote = match["value"][0] if match["value"][0] in "\"'" else ""
        return f"{match['head']}{quote}{REDACTED}{quote}{match['tail']}"

    return _TEXT_ASSIGNMENT_RE.sub(_line, redact_uri_credentials(text))


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def clean_key(key: str) -> str:
    """Make ``key`` a valid MLflow param/metric/tag name (allowed characters, no path tricks, <= 250)."""
    key = re.sub(r"[^/\w.\- :]", "_", str(key))
    # MLflow refuses names that normalise to another path ("a//b", "/a", "a/../b").
    key = "/".join(part for part in key.split("/") if part not in ("", ".", ".."))
    return (key or "_")[:MAX_KEY_LENGTH]


def _short(exc: BaseException, limit: int = 300) -> str:
    text = redact_uri_credentials(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[:limit] + "..."


def _is_outage(exc: BaseException) -> bool:
    """True for errors that mean "store unreachable / temporarily failing" (retry later).

    False for errors the store would repeat forever (a rejected value, a bug): those are logged and the
    data dropped from MLflow (it stays in the local JSONL), so one bad entry cannot block the queue.
    """
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:  # pragma: no cover
        MlflowException = ()  # type: ignore[assignment]
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        # 401/403 (credentials not yet valid), 408 (timeout) and 429 (rate limit) may heal by themselves.
        return not (400 <= status < 500) or status in (401, 403, 408, 429)
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    # requests / urllib3 / sqlalchemy connection errors, without importing those packages here.
    module = type(exc).__module__.split(".")[0]
    return module in ("requests", "urllib3", "sqlalchemy", "sqlite3")


def _is_not_found(exc: BaseException) -> bool:
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def _chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


class _LocalLog:
    """Append-only ``metrics.jsonl``: the copy of every metric/param that survives any MLflow outage."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the whole run

    def write(self, kind: str, items: list[tuple[str, Any, int | None]], when: float) -> None:
        """One JSON line per (key, value, step); flushed so that a crash loses nothing."""
        for key, value, step in items:
            line = {"kind": kind, "step": step, "key": key, "value": value, "time": when}
            self._file.write(json.dumps(line, default=str) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _tensorboard_writer(log_dir: Path):
    """A ``torch.utils.tensorboard.SummaryWriter``; a clear error when ``tensorboard`` is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "tracking.tensorboard=True needs the 'tensorboard' package (torch's SummaryWriter uses it): "
            "pip install tensorboard"
        )
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir))


# --------------------------------------------------------------------------------------------------
# Trackers
# --------------------------------------------------------------------------------------------------


def _while_open(method):
    """Make a logging method a no-op after :meth:`Tracker.finish` (its files are closed by then)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._closed:
            logger.debug("Tracker.%s after finish(): ignored", method.__name__)
            return None
        return method(self, *args, **kwargs)

    return wrapper


class NullTracker:
    """Same interface as :class:`Tracker`, doing nothing (ranks != 0, tracking disabled)."""

    run_id: str | None = None
    experiment_id: str | None = None

    def log_params(self, params: Mapping) -> None:
        """Do nothing."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Do nothing."""

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Do nothing."""

    def log_text(self, text: str, artifact_file: str) -> None:
        """Do nothing."""

    def log_dict(self, data: Mapping, artifact_file: str) -> None:
        """Do nothing."""

    def set_tags(self, tags: Mapping) -> None:
        """Do nothing."""

    def flush(self) -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""

    def finish(self, status: str = "FINISHED") -> None:
        """Do nothing."""


class Tracker:
    """MLflow run of one training job, logged from rank 0 only; tolerant of tracking-server outages.

    Create with :meth:`Tracker.start`. ``run_id`` is None only while the server has been unreachable
    since the start (the run is created when it answers): read it again before saving it for a resume.
    """

    def __init__(
        self,
        *,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        run_id: str | None,
        local_dir: str | Path,
        tensorboard: bool = False,
        parent_run_id: str | None = None,
        tags: Mapping | None = None,
        retry_interval_s: float = 30.0,
        max_pending: int = 200_000,
        new_measurements: bool = False,
    ):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.local_dir = Path(local_dir)
        self.retry_interval_s = retry_interval_s
        self.max_pending = max_pending
        # True: what is logged is measured anew (a re-evaluation), not a resumed job replaying its steps.
        self.new_measurements = new_measurements
        self._lock = threading.RLock()  # a metrics callback thread may log next to the training loop
        self._client = None
        self._requested_run_id = run_id
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._broken = False  # a permanent error while creating the run: MLflow off, JSONL continues
        # Outage state: offline after a failed call; the next try is not before _next_try.
        self._offline = False
        self._next_try = 0.0
        self._pending_overflow_warned = False
        # Queues: everything goes through them, so normal logging and replay are the same code path.
        self._pending_params: dict[str, str] = {}
        self._pending_tags: dict[str, str] = {}
        self._pending_metrics: list = []  # mlflow.entities.Metric, with their original timestamps
        self._pending_artifacts: list[tuple[str, Callable[[Any, str], None]]] = []
        self._terminal_status: str | None = None
        self._closed = False
        # What the run already holds (from a previous attempt of the job, or sent by us).
        self._known_params: dict[str, str] = {}
        self._resume_steps: dict[str, int] = {}  # metric key -> last step logged before this attempt
        self._resume_skip_logged = False
        self._local = _LocalLog(self.local_dir / "metrics.jsonl")
        self._tb = _tensorboard_writer(self.local_dir / "tensorboard") if tensorboard else None
        run_tags = dict(tags or {})
        if parent_run_id:
            run_tags[PARENT_RUN_TAG] = parent_run_id
        self._queue_tags(run_tags)

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        *,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        run_id: str | None,
        local_dir: str | Path,
        enabled: bool = True,
        tensorboard: bool = False,
        parent_run_id: str | None = None,
        tags: Mapping | None = None,
        retry_interval_s: float = 30.0,
        new_measurements: bool = False,
    ) -> Tracker | NullTracker:
        """Open (create, or resume when ``run_id`` is given) an MLflow run; a NullTracker if disabled.

        A resumed run gets no metric at a step it already has (a restarted job repeats the steps since its
        last checkpoint), unless ``new_measurements``: then every value is logged (re-scoring a finished
        run adds the new scores at its last step). The experiment is created if missing. An unreachable
        server is not an error: the run is created (or resumed) once it answers. Misconfiguration (a bad
        experiment name, an unknown URI scheme) raises here, at the start, rather than being discovered
        hours later.
        """
        if not enabled:
            return NullTracker()
        set_http_defaults()  # before the client exists, so that its first request is already bounded
        tracker = cls(
            tracking_uri=tracking_uri,
            experiment=experiment,
            run_name=run_name,
            run_id=run_id,
            local_dir=local_dir,
            tensorboard=tensorboard,
            parent_run_id=parent_run_id,
            tags=tags,
            retry_interval_s=retry_interval_s,
            new_measurements=new_measurements,
        )
        with tracker._lock:
            tracker._sync(force=True, at_start=True)
        return tracker

    @property
    def run_id(self) -> str | None:
        """The MLflow run id (the requested one while a resume waits for the server)."""
        return self._run_id or self._requested_run_id

    @property
    def experiment_id(self) -> str | None:
        """The MLflow experiment id (None until the server was reached once)."""
        return self._experiment_id

    @property
    def metrics_file(self) -> Path:
        """The local JSONL copy of every metric and param."""
        return self._local.path

    @property
    def offline(self) -> bool:
        """True while the tracking server is considered unreachable."""
        return self._offline

    # ---- public logging API ----------------------------------------------------------------------

    @_while_open
    def log_params(self, params: Mapping) -> None:
        """Log (nested) params: flattened with dots, redacted, ``str()``'d and cut to 6000 characters.

        A param already in the run with the same value is skipped (a resumed run); a changed value is
        skipped with a warning, because MLflow refuses to change a param.
        """
        flat = redact(flatten(params))
        items = {clean_key(k): str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in flat.items()}
        with self._lock:
            self._local.write("param", [(k, v, None) for k, v in items.items()], time.time())
            for key, value in items.items():
                if self._param_is_new(key, value, self._pending_params):
                    self._pending_params[key] = value
            self._sync()

    @_while_open
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step`` (MLflow, the local JSONL, and TensorBoard when on)."""
        from mlflow.entities import Metric

        now = time.time()
        items = [(clean_key(k), float(v), int(step)) for k, v in metrics.items()]
        with self._lock:
            self._local.write("metric", items, now)
            if self._tb is not None:
                for key, value, _ in items:
                    self._tb.add_scalar(key, value, int(step))
            timestamp = int(now * 1000)
            self._pending_metrics.extend(Metric(k, v, timestamp, s) for k, v, s in items)
            self._trim_pending()
            self._sync()

    @_while_open
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or folder; while the server is down it is queued (by path: keep the file)."""
        local = str(path)

        def send(client, run_id):
            if not os.path.exists(local):
                logger.warning("Artifact %s no longer exists; not uploaded to MLflow", local)
                return
            if os.path.isdir(local):
                client.log_artifacts(run_id, local, artifact_path)
            else:
                client.log_artifact(run_id, local, artifact_path)

        with self._lock:
            self._pending_artifacts.append((f"artifact {local}", send))
            self._sync()

    @_while_open
    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` (redacted: URI passwords, ``secret: value`` lines) as ``artifact_file``."""
        clean = redact_text(text)

        def send(client, run_id):
            client.log_text(run_id, clean, artifact_file)

        with self._lock:
            self._pending_artifacts.append((f"text artifact {artifact_file}", send))
            self._sync()

    def log_dict(self, data: Mapping, artifact_file: str) -> None:
        """Store a redacted dict as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
        clean = redact(data)
        if artifact_file.endswith((".yaml", ".yml")):
            import yaml

            text = yaml.safe_dump(json.loads(json.dumps(clean, default=str)), sort_keys=False)
        else:
            text = json.dumps(clean, indent=2, default=str)
        self.log_text(text, artifact_file)

    @_while_open
    def set_tags(self, tags: Mapping) -> None:
        """Set run tags (redacted, values cut to 8000 characters); tags may change, unlike params."""
        with self._lock:
            self._queue_tags(tags)
            self._sync()

    def flush(self) -> None:
        """Try once now (ignoring the retry interval) to send everything queued; the run stays open."""
        with self._lock:
            if not self._closed:
                self._sync(force=True)

    def close(self) -> None:
        """:meth:`flush` and close the local files, leaving the run's status alone.

        For a tracker that shares its run with another one that calls :meth:`finish` (e.g. the rank-0
        worker next to the driver).
        """
        self._end(status=None)

    def finish(self, status: str = "FINISHED") -> None:
        """Send what is queued (one forced try), mark the run ``FINISHED``/``FAILED``, close the files."""
        self._end(status=status)

    def _end(self, status: str | None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._terminal_status = status
            self._sync(force=True)
            unsent = self._pending_metrics or self._pending_params or self._terminal_status is not None
            if unsent and not self._broken:
                logger.warning(
                    "MLflow run %s could not be updated at the end (server unreachable); %d metric(s) are "
                    "only in %s",
                    self.run_id or "(never created)",
                    len(self._pending_metrics),
                    self._local.path,
                )
            if self._tb is not None:
                self._tb.close()
            self._local.close()

    # ---- queueing ----------------------------------------------------------------------------------

    def _queue_tags(self, tags: Mapping) -> None:
        for key, value in redact(dict(tags)).items():
            self._pending_tags[clean_key(key)] = str(value)[:MAX_TAG_VAL_LENGTH]

    def _param_is_new(self, key: str, value: str, *others: Mapping[str, str]) -> bool:
        """False for a param already logged (same value: silently; changed value: with a warning)."""
        for source in (self._known_params, *others):
            if key in source:
                if source[key] != value:
                    logger.warning(
                        "Param %r is already %r in MLflow run %s; not changed to %r (MLflow params are "
                        "immutable; the new value is in %s)",
                        key, source[key], self.run_id, value, self._local.path,
                    )  # fmt: skip
                return False
        return True

    def _trim_pending(self) -> None:
        """Bound the replay queue during a very long outage (the JSONL still has everything)."""
        excess = len(self._pending_metrics) - self.max_pending
        if excess > 0:
            del self._pending_metrics[:excess]
            if not self._pending_overflow_warned:
                self._pending_overflow_warned = True
                logger.warning(
                    "More than %d metrics queued for MLflow; the oldest are dropped from the replay "
                    "(all are in %s)", self.max_pending, self._local.path,
                )  # fmt: skip

    # ---- the one guarded path to MLflow ------------------------------------------------------------

    def _sync(self, force: bool = False, at_start: bool = False) -> None:
        """Create/resume the run if needed and send everything queued; never raises on an outage.

        While offline, MLflow is tried at most every ``retry_interval_s`` (``force`` ignores that), so a
        dead server costs at most one bounded timeout per interval.
        """
        if self._broken:
            return
        if self._offline and not force and time.monotonic() < self._next_try:
            return
        try:
            self._ensure_run(at_start)
        except Exception as exc:
            if _is_outage(exc):
                self._go_offline(exc)
                return
            if at_start:
                raise
            self._broken = True
            logger.error(
                "MLflow run could not be created (%s); only %s is written", _short(exc), self._local.path
            )
            return
        try:
            sent = self._flush()
        except Exception as exc:  # _flush lets only outages through
            self._go_offline(exc)
            return
        self._go_online(sent)

    def _go_offline(self, exc: BaseException) -> None:
        self._next_try = time.monotonic() + self.retry_interval_s
        if self._offline:
            return
        self._offline = True
        logger.warning(
            "MLflow tracking server %s is unreachable (%s). Metrics and params are kept in %s and will be "
            "sent when it is back; retrying at most every %g s.",
            redact_uri_credentials(self.tracking_uri), _short(exc), self._local.path, self.retry_interval_s,
        )  # fmt: skip

    def _go_online(self, sent_metrics: int) -> None:
        if self._offline:
            logger.warning(
                "MLflow tracking server %s is reachable again; sent %d queued metric(s) to run %s",
                redact_uri_credentials(self.tracking_uri), sent_metrics, self._run_id,
            )  # fmt: skip
        self._offline = False

    def _get_client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _ensure_run(self, at_start: bool) -> None:
        """Attach to the requested run, or create one, once per tracker."""
        if self._run_id is not None:
            return
        client = self._get_client()
        if self._requested_run_id is not None:
            try:
                self._attach(client, self._requested_run_id)
                return
            except Exception as exc:
                if not _is_not_found(exc):
                    raise
                logger.warning(
                    "MLflow run %s to resume does not exist in %s; starting a new run",
                    self._requested_run_id, redact_uri_credentials(self.tracking_uri),
                )  # fmt: skip
                self._requested_run_id = None
        if self._experiment_id is None:
            self._experiment_id = self._get_or_create_experiment(client)
        run = client.create_run(self._experiment_id, run_name=self.run_name)
        self._run_id = run.info.run_id
        logger.info("MLflow run %s created in experiment %r", self._run_id, self.experiment)

    def _attach(self, client, run_id: str) -> None:
        """Resume ``run_id``: learn its params and last metric steps so that nothing is logged twice."""
        run = client.get_run(run_id)
        self._known_params = dict(run.data.params)
        metrics = getattr(run.data, "_metric_objs", None)
        if metrics is None:  # private attribute gone in some MLflow version: ask per key
            metrics = [m for key in run.data.metrics for m in client.get_metric_history(run_id, key)]
        for metric in [] if self.new_measurements else metrics:
            self._resume_steps[metric.key] = max(metric.step, self._resume_steps.get(metric.key, metric.step))
        if run.info.status != "RUNNING":
            client.update_run(run_id, status="RUNNING")
        self._experiment_id = run.info.experiment_id
        self._run_id = run_id
        logger.info(
            "Resuming MLflow run %s (%d params, %d metric keys)",
            run_id, len(self._known_params), len(self._resume_steps),
        )  # fmt: skip

    def _get_or_create_experiment(self, client) -> str:
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(self.experiment, artifact_location=self._artifact_location())
        except Exception as exc:
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
            # Another job created it between our two calls.
            return client.get_experiment_by_name(self.experiment).experiment_id

    def _artifact_location(self) -> str | None:
        """Artifacts next to an embedded sqlite DB; MLflow's default is ``./mlruns`` under the (Ray) cwd."""
        if not self.tracking_uri.startswith("sqlite:///"):
            return None  # a server decides (it proxies artifacts by default)
        db_path = Path(self.tracking_uri[len("sqlite:///") :])
        return (db_path.parent / "mlartifacts").as_uri()

    def _flush(self) -> int:
        """Send queued params, tags, metrics, artifacts and the final status; returns metrics sent.

        Items leave a queue only once MLflow accepted (or permanently rejected) them, so an outage in the
        middle loses nothing; outages propagate to :meth:`_sync`.
        """
        from mlflow.entities import Param, RunTag

        client, run_id = self._client, self._run_id
        params = {k: v for k, v in self._pending_params.items() if self._param_is_new(k, v)}
        for chunk in _chunks(list(params.items()), MAX_PARAMS_TAGS_PER_BATCH):
            self._send("params", lambda: client.log_batch(run_id, params=[Param(k, v) for k, v in chunk]))
            self._known_params.update(chunk)
            for key, _ in chunk:
                self._pending_params.pop(key, None)
        self._pending_params.clear()  # what is left was already in the run
        for chunk in _chunks(list(self._pending_tags.items()), MAX_PARAMS_TAGS_PER_BATCH):
            self._send("tags", lambda: client.log_batch(run_id, tags=[RunTag(k, v) for k, v in chunk]))
            for key, _ in chunk:
                self._pending_tags.pop(key, None)
        sent = self._flush_metrics(client, run_id)
        while self._pending_artifacts:
            what, send = self._pending_artifacts[0]
            self._send(what, lambda: send(client, run_id))
            self._pending_artifacts.pop(0)
        if self._terminal_status is not None:
            self._send("run status", lambda: client.set_terminated(run_id, self._terminal_status))
            self._terminal_status = None
        return sent

    def _flush_metrics(self, client, run_id: str) -> int:
        # A resumed job repeats the steps between its last checkpoint and the crash: the run already has
        # them from the previous attempt, and a second point per step would make the history zigzag.
        if self._resume_steps:
            before = len(self._pending_metrics)
            self._pending_metrics = [
                m for m in self._pending_metrics if m.step > self._resume_steps.get(m.key, -math.inf)
            ]
            if len(self._pending_metrics) < before and not self._resume_skip_logged:
                self._resume_skip_logged = True  # once: every call until the resume point would repeat it
                logger.info(
                    "Not re-sending metrics at steps the resumed run already has (up to %s)", self._resume_steps
                )
        sent = 0
        while self._pending_metrics:
            batch = self._pending_metrics[:MAX_METRICS_PER_BATCH]
            self._send("metrics", lambda: client.log_batch(run_id, metrics=batch))
            del self._pending_metrics[: len(batch)]
            sent += len(batch)
        return sent

    def _send(self, what: str, call: Callable[[], Any]) -> None:
        """Run one MLflow call: outages propagate; a permanent rejection is logged and swallowed."""
        try:
            call()
        except Exception as exc:
            if _is_outage(exc):
                raise
            logger.warning("MLflow rejected %s (%s); kept only in %s", what, _short(exc), self._local.path)


def make_tracker(is_rank0: bool, **kwargs: Any) -> Tracker | NullTracker:
    """:meth:`Tracker.start` on rank 0 with tracking enabled; a :class:`NullTracker` everywhere else."""
    if not is_rank0 or not kwargs.get("enabled", True):
        return NullTracker()
    return Tracker.start(**kwargs)
