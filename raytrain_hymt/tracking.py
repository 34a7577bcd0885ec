"""MLflow tracking for the driver and rank 0 of a training job; every other rank gets a :class:`NullTracker`.

* Explicit run ids (``MlflowClient``), never ``mlflow.start_run``: Ray restarts workers; a global run would not last.
* One run per job, by id or else by the job's key (:data:`~raytrain_hymt.tracking_store.RUN_KEY_TAG`). The driver
  logs before and after ``fit``, rank 0 during it: never both at once, so only one of them creates the run.
* An outage never stops training. Metrics go out through MLflow's async queue (``log_batch(synchronous=False)``),
  one batch at a time; that queue drops a failed batch, so ours keeps each batch until MLflow took it. After a
  failure MLflow is tried again at most every ``retry_interval_s`` (one warning per outage).
* Everything is also in ``metrics.jsonl``; a tracker that finds its run first sends what that file holds from
  earlier attempts and the run lacks. Secrets are redacted (:mod:`raytrain_hymt.redact`) before all of this.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from raytrain_hymt.config import flatten
from raytrain_hymt.metrics_log import MetricsLog, read_metrics
from raytrain_hymt.redact import redact, redact_text, redact_uri_credentials
from raytrain_hymt.tracking_store import (MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH, RUN_KEY_TAG,
                                          clean_key, find_or_create_run, is_outage, set_http_defaults)

logger = logging.getLogger(__name__)
PARENT_RUN_TAG = "mlflow.parentRunId"
Send = Callable[[Any], None]  # one synchronous MLflow call, given the client


def _short(exc: BaseException, limit: int = 300) -> str:
    text = redact_uri_credentials(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= limit else text[:limit] + "..."


def _while_open(method):
    """Make a logging method a no-op after :meth:`Tracker.finish` (its files are closed by then)."""
    return functools.wraps(method)(lambda self, *args, **kwargs: None if self._closed else method(self, *args, **kwargs))


class NullTracker:
    """Same interface as :class:`Tracker`, doing nothing (ranks != 0, tracking disabled)."""

    run_id = experiment_id = run_key = None

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing."""

    log_params = log_metrics = log_artifact = log_text = log_dict = set_tags = flush = close = finish = _nothing


class Tracker:
    """MLflow run of one training job, tolerant of tracking-server outages; create with :meth:`start`.

    ``run_id`` is the requested id until the run is found (None: not found or created yet). A resumed run gets no
    metric at a step it already has (a restarted job repeats the steps since its last checkpoint), unless
    ``new_measurements``: then every value is logged (re-scoring a finished run adds scores at its last step).
    """

    def __init__(self, *, tracking_uri: str, experiment: str, run_name: str, run_id: str | None, local_dir: str | Path,
                 run_key: str | None = None, tensorboard: bool = False, parent_run_id: str | None = None,
                 tags: Mapping | None = None, retry_interval_s: float = 30.0, max_pending: int = 200_000,
                 new_measurements: bool = False):
        self.tracking_uri, self.experiment, self.run_name, self.run_key = tracking_uri, experiment, run_name, run_key
        self.run_id, self.experiment_id = run_id, None
        self.retry_interval_s, self.max_pending, self.new_measurements = retry_interval_s, max_pending, new_measurements
        self._lock = threading.RLock()  # a metrics callback thread may log next to the training loop
        self._client = self._inflight = self._status = None  # _inflight: (RunOperations, metrics) of the batch out
        self._attached = self._broken = self._offline = self._closed = False
        self._next_try = 0.0  # while offline, MLflow is not tried before this
        self._metrics: list = []  # mlflow.entities.Metric (original timestamps) that MLflow has yet to take
        self._calls: list[tuple[str, Send]] = []  # params, tags, artifacts: in order, each until it went through
        self._known_params: dict[str, str] = {}  # what the run holds
        self._last_step: dict[str, int] = {}  # metric key -> the last step the run has or is sent
        self._local = MetricsLog(Path(local_dir), tensorboard)
        # The lines of earlier attempts; a re-evaluation (new_measurements) only adds to the run, it replays nothing.
        self._history_end = 0 if new_measurements else self._local.size_at_open
        self._calls.append(self._tags_call({**(tags or {}), **({PARENT_RUN_TAG: parent_run_id} if parent_run_id else {}),
                                            **({RUN_KEY_TAG: run_key} if run_key else {})}))

    @classmethod
    def start(cls, *, enabled: bool = True, **kwargs: Any) -> Tracker | NullTracker:
        """Open (create, or resume by ``run_id`` or ``run_key``) an MLflow run; a NullTracker if disabled.

        An unreachable server is not an error: the run is found or created once it answers. Misconfiguration (a bad
        experiment name, an unknown URI scheme) raises here, rather than hours later.
        """
        if not enabled:
            return NullTracker()
        set_http_defaults()  # before the client exists, so that its first request is already bounded
        tracker = cls(**kwargs)
        with tracker._lock:
            tracker._sync(force=True, at_start=True)
        return tracker

    @property
    def offline(self) -> bool:
        """True while the tracking server is considered unreachable (after the batch in flight, which may decide it)."""
        with self._lock:
            try:
                self._harvest(wait=True)
            except Exception as exc:  # _harvest lets only outages through
                self._go_offline(exc)
            return self._offline

    @_while_open
    def log_params(self, params: Mapping) -> None:
        """Log (nested) params: flattened with dots, redacted, ``str()``'d and cut to 6000 characters. A param the
        run has is skipped: silently with the same value (a resumed run), else with a warning (they are immutable)."""
        items = {clean_key(k): str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in redact(flatten(params)).items()}
        with self._lock:
            self._local.write("param", [(k, v, None) for k, v in items.items()], time.time())
            self._queue("params", functools.partial(self._send_params, items))

    @_while_open
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step`` (MLflow, the local JSONL, and TensorBoard when on)."""
        from mlflow.entities import Metric

        now, items = time.time(), [(clean_key(k), float(v), int(step)) for k, v in metrics.items()]
        with self._lock:
            self._local.write("metric", items, now)
            new = [Metric(k, v, int(now * 1000), s) for k, v, s in items]
            self._metrics += self._admit(new) if self._attached else new  # filtered when the run is found
            if len(self._metrics) > self.max_pending:  # a very long outage: the oldest stay only in metrics.jsonl
                logger.warning("%d metrics queued for MLflow: the oldest %d are dropped from the queue (all are in %s)",
                               len(self._metrics), len(self._metrics) - self.max_pending, self._local.path)
                del self._metrics[: -self.max_pending]
            self._sync()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file or folder; while the server is down it is queued (by path: keep the file)."""
        upload = "log_artifacts" if os.path.isdir(path) else "log_artifact"
        self._queue(f"artifact {path}", lambda client: getattr(client, upload)(self.run_id, str(path), artifact_path))

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` (redacted: URI passwords, ``secret: value`` lines) as ``artifact_file``."""
        clean = redact_text(text)
        self._queue(f"text artifact {artifact_file}", lambda client: client.log_text(self.run_id, clean, artifact_file))

    def log_dict(self, data: Mapping, artifact_file: str) -> None:
        """Store a redacted dict as YAML (``.yaml``/``.yml``) or JSON (anything else)."""
        import yaml

        clean = json.loads(json.dumps(redact(data), default=str))
        yml = artifact_file.endswith((".yaml", ".yml"))
        self.log_text(yaml.safe_dump(clean, sort_keys=False) if yml else json.dumps(clean, indent=2), artifact_file)

    def set_tags(self, tags: Mapping) -> None:
        """Set run tags (redacted, values cut to 8000 characters); tags may change, unlike params."""
        self._queue(*self._tags_call(tags))

    def flush(self) -> None:
        """Try once now (ignoring the retry interval) to send everything queued; the run stays open."""
        with self._lock:
            if not self._closed:
                self._sync(force=True, drain=True)

    def close(self) -> None:
        """:meth:`flush` and close the local files, leaving the run's status alone (for a tracker that shares its run
        with one that calls :meth:`finish`: the rank-0 worker next to the driver)."""
        self.finish(status=None)

    def finish(self, status: str | None = "FINISHED") -> None:
        """Send what is queued (one forced try), mark the run ``FINISHED``/``FAILED``, close the files."""
        with self._lock:
            if self._closed:
                return
            self._closed, self._status = True, status
            self._sync(force=True, drain=True)
            if (self._metrics or self._calls or self._status) and not self._broken:
                logger.warning("MLflow run %s could not be updated at the end (server unreachable); %d metric(s) are "
                               "only in %s", self.run_id or "(never created)", len(self._metrics), self._local.path)
            self._local.close()

    @_while_open
    def _queue(self, what: str, send: Send) -> None:
        with self._lock:
            self._calls.append((what, send))
            self._sync()

    def _tags_call(self, tags: Mapping) -> tuple[str, Send]:
        from mlflow.entities import RunTag

        clean = [RunTag(clean_key(k), str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in redact(dict(tags)).items()]
        return "tags", lambda client: client.log_batch(self.run_id, tags=clean)

    def _send_params(self, params: dict[str, str], client) -> None:
        from mlflow.entities import Param

        new = {}
        for key, value in params.items():
            if key not in self._known_params:
                new[key] = value
            elif self._known_params[key] != value:
                logger.warning("Param %r is already %r in MLflow run %s; not changed to %r (MLflow params are immutable; "
                               "the new value is in %s)", key, self._known_params[key], self.run_id, value, self._local.path)
        client.log_batch(self.run_id, params=[Param(k, v) for k, v in new.items()])  # sent 100 a request by MLflow
        self._known_params.update(new)

    def _admit(self, metrics: list) -> list:
        """The metrics at steps the run does not have yet: a resumed job repeats the steps since its last checkpoint,
        and a second point per step would make the history zigzag (the first value stays)."""
        fresh = []
        for m in metrics:
            if self.new_measurements or m.step > self._last_step.get(m.key, -math.inf):
                self._last_step[m.key] = m.step
                fresh.append(m)
        return fresh

    # ---- the one guarded path to MLflow ------------------------------------------------------------------------

    def _sync(self, force: bool = False, at_start: bool = False, drain: bool = False) -> None:
        """Find or create the run, then send what is queued (``drain``: wait until all is sent); never raises on an
        outage. While offline MLflow is tried at most every ``retry_interval_s`` (``force`` ignores that), so a dead
        server costs at most one bounded timeout per interval."""
        if self._broken or (self._offline and not force and time.monotonic() < self._next_try):
            return
        try:
            self._attach()
        except Exception as exc:
            if is_outage(exc):
                return self._go_offline(exc)
            if at_start:
                raise
            self._broken = True
            return logger.error("MLflow run could not be created (%s); only %s is written", _short(exc), self._local.path)
        try:
            while self._calls:
                self._call(*self._calls[0])
                self._calls.pop(0)
            self._harvest(wait=drain)
            while self._metrics and self._inflight is None:
                batch, self._metrics = self._metrics[:MAX_METRICS_PER_BATCH], self._metrics[MAX_METRICS_PER_BATCH:]
                self._inflight = (self._client.log_batch(self.run_id, metrics=batch, synchronous=False), batch)
                self._harvest(wait=drain)
            if self._status and self._inflight is None:
                self._call("run status", lambda client: client.set_terminated(self.run_id, self._status))
                self._status = None
        except Exception as exc:  # _call and _harvest let only outages through
            self._go_offline(exc)

    def _harvest(self, wait: bool) -> None:
        """Settle the batch in flight once it is done (``wait``: wait for it). MLflow took it, or refused it for good:
        it is gone. An outage: it goes back to the front of the queue, and the error is raised."""
        if self._inflight is None:
            return
        operations, batch = self._inflight
        # RunOperations.wait() folds every error into one MlflowException (HTTP 500), which would make a refused
        # batch look like an outage; its futures keep the errors themselves.
        futures = operations._operation_futures
        if not wait and not all(f.done() for f in futures):
            return
        self._inflight = None
        exc = next((e for e in (f.exception() for f in futures) if e is not None), None)
        if exc is None:
            return self._go_online()
        if not is_outage(exc):
            return self._rejected("metrics", exc)
        self._metrics[:0] = batch
        raise exc

    def _call(self, what: str, send: Send) -> None:
        """One synchronous MLflow call: outages propagate; a permanent rejection is logged and swallowed."""
        try:
            send(self._client)
        except Exception as exc:
            if is_outage(exc):
                raise
            return self._rejected(what, exc)
        self._go_online()

    def _rejected(self, what: str, exc: BaseException) -> None:
        logger.warning("MLflow rejected %s (%s); kept only in %s", what, _short(exc), self._local.path)

    def _go_offline(self, exc: BaseException) -> None:
        self._next_try = time.monotonic() + self.retry_interval_s
        if not self._offline:
            self._offline = True
            logger.warning("MLflow tracking server %s is unreachable (%s). Metrics and params are kept in %s and will be "
                           "sent when it is back; retrying at most every %g s.", redact_uri_credentials(self.tracking_uri),
                           _short(exc), self._local.path, self.retry_interval_s)

    def _go_online(self) -> None:
        if self._offline:
            logger.warning("MLflow tracking server %s is reachable again; sending %d queued metric(s) to run %s",
                           redact_uri_credentials(self.tracking_uri), len(self._metrics), self.run_id)
        self._offline = False

    def _attach(self) -> None:
        """Find or create the job's run, once: learn its params and last metric steps, so that nothing is logged twice,
        and queue in front what earlier attempts wrote to ``metrics.jsonl`` and the run lacks."""
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        if self._attached:
            return
        self._client = self._client or MlflowClient(tracking_uri=self.tracking_uri)
        run = find_or_create_run(self._client, self.tracking_uri, self.experiment, self.run_name, self.run_id, self.run_key)
        self._known_params = dict(run.data.params)
        for m in [] if self.new_measurements else run.data._metric_objs:  # each key's metric at its last step
            self._last_step[m.key] = m.step
        history = [Metric(k, v, int(t * 1000), s) for k, v, s, t in read_metrics(self._local.path, self._history_end)]
        self._metrics = self._admit(history + self._metrics)
        self.run_id, self.experiment_id, self._attached = run.info.run_id, run.info.experiment_id, True
        logger.info("MLflow run %s of experiment %r: %d params, %d metric keys, %d metric(s) to send",
                    self.run_id, self.experiment, len(self._known_params), len(self._last_step), len(self._metrics))
        self._go_online()


def make_tracker(is_rank0: bool, **kwargs: Any) -> Tracker | NullTracker:
    """:meth:`Tracker.start` on rank 0 with tracking enabled; a :class:`NullTracker` everywhere else."""
    return Tracker.start(**kwargs) if is_rank0 and kwargs.get("enabled", True) else NullTracker()
