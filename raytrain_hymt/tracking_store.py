"""The MLflow side of a job's tracking: which store (URI), how long one request may take, what the store
accepts (names, lengths) and which of its errors mean "try later", and which experiment and run a job logs to.

Stateless: the tracker (:mod:`raytrain_hymt.tracking`) holds the queue and the outage state. Importing this
module does not import mlflow (ranks != 0 and GPU images without mlflow only need a NullTracker).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from raytrain_hymt.redact import redact_uri_credentials
from raytrain_hymt.storage import is_uri

logger = logging.getLogger(__name__)

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
    # MLflow's async queue logs each failed batch with the request URL, password included; the tracker says it
    # itself, redacted and once per outage.
    logging.getLogger("mlflow.utils.async_logging.async_logging_queue").setLevel(logging.CRITICAL)


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

    def __init__(self, run=None, every_step: bool = False):
        self.params: dict[str, str] = dict(run.data.params) if run else {}
        self.every_step = every_step
        # _metric_objs (MLflow 3.17): each key's latest metric, the one at its last step.
        self.last_step = {m.key: m.step for m in run.data._metric_objs} if run and not every_step else {}

    def admit(self, metrics: list) -> list:
        """The metrics (``mlflow.entities.Metric``, in logging order) at steps the run does not have; they count as
        had from now on."""
        fresh = []
        for m in metrics:
            if self.every_step or m.step > self.last_step.get(m.key, -1):
                self.last_step[m.key] = m.step
                fresh.append(m)
        return fresh
