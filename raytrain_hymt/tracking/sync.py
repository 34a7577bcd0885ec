"""``hymt sync``: send what a run's ``metrics.jsonl`` holds and its MLflow run lacks, after an outage.

A job whose tracking server stayed down to its end (or that was stopped before the server came back) has
its metrics and params only in ``metrics.jsonl``. Sync finds the run's MLflow run (the id in ``run.json``,
else the job's key tag, else a new run, whose id is then written to ``run.json``), asks MLflow which steps
each metric already has, and sends the others: each (metric, step) once, with its original value and
timestamp, the first value where a resumed job logged a step twice (as the tracker keeps it). What the run
holds is the record, so a second sync, or one after the job's own tracker caught up, sends nothing. Params
MLflow lacks are sent the same way (MLflow params never change). No Ray, no training process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raytrain_hymt.tracking.metrics_log import read_metrics, read_params
from raytrain_hymt.tracking.tracker import MAX_METRICS_PER_BATCH, find_or_create_run, set_http_defaults

#: MLflow takes at most this many params per ``log_batch`` request (mlflow.utils.validation, 3.17).
MAX_PARAMS_PER_BATCH = 100


@dataclass
class SyncResult:
    """What one sync sent to which MLflow run."""

    run_id: str
    metrics_sent: int
    params_sent: int
    steps: tuple[int, int] | None
    """The lowest and highest step among the metrics sent (None: none sent)."""


def sync_metrics(metrics_path: Path, *, tracking_uri: str, experiment: str, run_name: str, run_id: str | None,
                 run_key: str | None, finished: bool) -> SyncResult:
    """Send what ``metrics_path`` holds and the MLflow run lacks (see the module docstring).

    The run keeps the status it had; one still ``RUNNING`` (its job never reached MLflow at its end) or
    created here becomes ``FINISHED`` when ``finished`` (the run wrote its summary), else ``FAILED``.
    Raises what MLflow raises (an unreachable server included): nothing is recorded locally, so a sync
    that failed half-way is simply run again.
    """
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    set_http_defaults()
    client = MlflowClient(tracking_uri=tracking_uri)
    run = find_or_create_run(client, tracking_uri, experiment, run_name, run_id, run_key)
    rid, before = run.info.run_id, run.info.status  # as read before find_or_create_run marked it RUNNING
    had = {key: {m.step for m in client.get_metric_history(rid, key)} for key in run.data.metrics}
    fresh = []
    for key, value, step, when in read_metrics(metrics_path):
        steps = had.setdefault(key, set())
        if step not in steps:
            steps.add(step)
            fresh.append(Metric(key, value, int(when * 1000), step))
    params = [Param(k, v) for k, v in read_params(metrics_path).items() if k not in run.data.params]
    for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(rid, params=params[i:i + MAX_PARAMS_PER_BATCH], synchronous=True)
    for i in range(0, len(fresh), MAX_METRICS_PER_BATCH):
        client.log_batch(rid, metrics=fresh[i:i + MAX_METRICS_PER_BATCH], synchronous=True)
    if before == "RUNNING":
        client.set_terminated(rid, "FINISHED" if finished else "FAILED")
    else:  # its end time stays
        client.update_run(rid, status=before)
    steps = (min(m.step for m in fresh), max(m.step for m in fresh)) if fresh else None
    return SyncResult(run_id=rid, metrics_sent=len(fresh), params_sent=len(params), steps=steps)
