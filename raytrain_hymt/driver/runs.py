"""A run's folder as the driver sees it: its name, its MLflow run (``run.json``) and its summary.

A run lives in ``<storage_root>/<name>/``: Ray's checkpoints (``checkpoint_step*``), ``run.json`` (the
MLflow run id and the job's key, so a re-submitted job continues the same MLflow run), ``config.yaml``,
``model/`` (the exported Hugging Face folder) and ``summary.json`` (written last; a finished run prints it
and exits).
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from raytrain_hymt.config.schema import Config, to_yaml
from raytrain_hymt.driver.session import use_driver_env
from raytrain_hymt.storage import CONFIG_FILE, METRICS_FILE, RUN_FILE, SUMMARY_FILE, RunFolder

log = logging.getLogger("raytrain_hymt")


@dataclass
class TrainingSummary:
    """Where a finished run's results are."""

    name: str
    run_dir: str
    checkpoint: str
    model_dir: str | None
    steps: int
    train_loss: float
    val_loss: float | None
    wall_time_s: float
    tracking_uri: str | None
    mlflow_run_id: str | None
    mlflow_experiment: str | None
    test_scores: dict | None = None
    """``{"test_set": name, "scores": {direction: {"bleu", "chrf", ...}}}`` when ``eval.test_set`` was set."""
    started_at: int = 0
    """The step the submission that finished the run resumed from (0: it trained every step). ``steps`` and
    ``wall_time_s`` are the run's total and this submission's time."""

    def lines(self) -> list[str]:
        """What the user reads at the end of a run."""
        val = f", validation loss {self.val_loss:.4f}" if self.val_loss is not None else ""
        steps = f"{self.steps} steps" if not self.started_at else (
            f"trained {self.steps - self.started_at} steps this time (steps {self.started_at + 1}-{self.steps}), "
            f"{self.steps} in total,")
        out = [
            f"run {self.name}: {steps} in {self.wall_time_s:.0f} s, train loss {self.train_loss:.4f}{val}",
            f"  checkpoint:   {self.checkpoint}",
        ]
        if self.test_scores:
            scores = ", ".join(f"{d} {s['bleu']:.2f}/{s['chrf']:.2f}" for d, s in self.test_scores["scores"].items())
            out.append(f"  BLEU/chrF:    {scores}  ({self.test_scores['test_set']})")
        if self.model_dir:
            out.append(f"  model:        {self.model_dir}  (AutoModelForCausalLM.from_pretrained loads it)")
        if self.mlflow_run_id:
            out.append(f"  MLflow run:   {self.mlflow_run_id} in experiment '{self.mlflow_experiment}' at {self.tracking_uri}")
            if self.tracking_uri and self.tracking_uri.startswith("sqlite:"):
                out.append(f"  open the UI:  mlflow ui --backend-store-uri {self.tracking_uri}")
            else:
                out.append(f"  open the UI:  {self.tracking_uri}")
        return out


def run_name(cfg: Config) -> str:
    """The configured name, or ``<preset>-<timestamp>``."""
    return cfg.run.name or f"{cfg.preset}-{datetime.now():%Y%m%d-%H%M%S}"


def create_run_folder(folder: RunFolder, cfg: Config) -> None:
    """Make the folder of a run that passed every check before training (Ray started, the workers fit)
    and write its first ``config.yaml``; a re-submission's folder exists and was checked already."""
    from raytrain_hymt.driver.resume import keep_first_config

    folder.create()
    if folder.read_text(CONFIG_FILE) is None:
        keep_first_config(folder, cfg)


def trained_a_step(folder: RunFolder) -> bool:
    """Whether the run in ``folder`` trained at least one step: it has a checkpoint, or a metric of step 1
    or later (a run can fail between checkpoints; its metrics are kept then too)."""
    from raytrain_hymt.train.checkpoint import list_checkpoints

    if list_checkpoints(folder.fs, folder.path):
        return True
    for line in (folder.read_text(METRICS_FILE) or "").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "metric" and (record.get("step") or 0) >= 1:
            return True
    return False


def discard_unstarted(folder: RunFolder) -> None:
    """Remove the run folder this submission created when the run failed before training a step (Ray did
    not start, the data or the workers failed): its ``config.yaml`` would hold the name to a config that
    never trained, and a re-submission under that name with the mistake fixed would be refused as a
    changed config. A folder that existed before, or any trace of a trained step, is kept."""
    if folder.created and not trained_a_step(folder):
        log.info("run %s failed before its first step: its folder %s is removed, the name is free again",
                 folder.uri.rsplit("/", 1)[-1], folder.uri)
        folder.remove()


def start_tracking(cfg: Config, run_dir: Path, parent_run_id: str | None = None, new_measurements: bool = False):
    """Create or resume (id and key in ``<run_dir>/run.json``) the MLflow run of ``run_dir``; log its config.

    Returns ``(tracker, tracking_uri)``; ``(NullTracker, None)`` when tracking is off. ``parent_run_id``
    makes it a child run (a search's trial); ``new_measurements``: see ``Tracker.start``.
    """
    from raytrain_hymt.tracking.tracker import make_tracker
    from raytrain_hymt.tracking.tracker import resolve_tracking_uri

    if not cfg.tracking.enabled:
        return make_tracker(False), None
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.run.storage_path)
    saved = json.loads((run_dir / RUN_FILE).read_text()) if (run_dir / RUN_FILE).exists() else {}
    run_key = saved.get("mlflow_run_key") or uuid.uuid4().hex  # finds the run while its id is unknown (server down)
    tracker = make_tracker(
        True, tracking_uri=uri, experiment=cfg.tracking.experiment, run_name=cfg.run.name,
        run_id=saved.get("mlflow_run_id"), run_key=run_key, local_dir=run_dir, tensorboard=False,
        parent_run_id=parent_run_id, retry_interval_s=cfg.tracking.retry_interval_s,
        new_measurements=new_measurements,
    )
    (run_dir / RUN_FILE).write_text(json.dumps({"mlflow_run_id": tracker.run_id, "mlflow_run_key": run_key, "tracking_uri": uri}))
    tracker.log_params(cfg.model_dump(mode="json"))  # flattened and redacted by the tracker
    tracker.log_text(to_yaml(cfg), CONFIG_FILE)
    return tracker, uri


def finished_summary(cfg: Config) -> TrainingSummary | None:
    """The summary of a run of this name that already finished, or None (no such run, not finished, or
    finished and submitted again with a larger ``optim.max_steps``: it continues). Submitted again with a
    config that would train something else, it stops here with one ``ConfigError``, before Ray starts
    (``resume.check_finished``)."""
    from raytrain_hymt.driver.resume import check_finished, resubmission_diffs
    from raytrain_hymt.storage import RunFolder

    use_driver_env(cfg)
    if not cfg.run.name:
        return None
    folder = RunFolder(cfg.run.storage_path, cfg.run.name, create=False)
    text = folder.read_text(SUMMARY_FILE)
    if not text:
        return None
    summary = TrainingSummary(**json.loads(text))
    resolve_init_from(cfg)  # the saved config holds the resolved checkpoint
    continues, _ = check_finished(resubmission_diffs(folder, cfg) or [], summary.steps, cfg.run.name,
                                  cfg.run.allow_config_change)
    return None if continues else summary


def resolve_init_from(cfg: Config) -> None:
    """Check ``model.init_from`` before Ray starts and replace it with the full location of the checkpoint
    it names (a run's newest whole one unless it names one), which the run's config and MLflow params keep.
    A missing run or checkpoint, a cut-off checkpoint, an exported model folder, or a source that trained
    another model (or LoRA against full weights, another base or adapter shape) is one ``ConfigError``.
    A location it resolved resolves to itself."""
    import pyarrow.fs
    import yaml

    from raytrain_hymt.errors import ConfigError
    from raytrain_hymt.storage import RunFolder, is_uri
    from raytrain_hymt.train.checkpoint import (
        CHECKPOINT_DIR_RE,
        BaseModelMismatchError,
        IncompleteCheckpointError,
        check_base_model,
        check_checkpoint,
        newest_whole_checkpoint,
    )

    value = cfg.model.init_from
    if not value:
        return
    head, _, last = value.rstrip("/").rpartition("/")
    name = last if head and CHECKPOINT_DIR_RE.match(last) else None
    run = head if name else value.rstrip("/")
    if not is_uri(run) and ("/" in run or run.startswith((".", "~"))):
        run = str(Path(run).expanduser().resolve())
    # A path or URI names the run folder itself; a bare name is a run under run.storage_root.
    root, _, run = run.rpartition("/") if "/" in run else (cfg.run.storage_path, "", run)
    folder = RunFolder(root or "/", run, create=False)
    fs, path, where = folder.fs, folder.path, folder.uri
    said = f"model.init_from {value!r}"
    if fs.get_file_info(path).type != pyarrow.fs.FileType.Directory:
        under = f" (no run {run!r} under run.storage_root)" if root == cfg.run.storage_path else ""
        raise ConfigError(f"{said}: no run folder {where}{under}")
    if fs.get_file_info(f"{path}/config.json").type == pyarrow.fs.FileType.File:
        raise ConfigError(f"{said}: {where} is an exported model folder, not a run; start from it with "
                          f"--set model.name_or_path={where} instead")
    if cfg.run.name and where == f"{cfg.run.storage_path.rstrip('/')}/{cfg.run.name}":
        raise ConfigError(f"{said} is this run itself; submit it again without model.init_from to resume it")
    try:
        if name:
            state = check_checkpoint(fs, f"{path}/{name}")
        else:
            newest = newest_whole_checkpoint(fs, path)
            if newest is None:
                raise ConfigError(f"{said}: {where} has no whole checkpoint (no checkpoint_step* folder with every "
                                  "rank's part)")
            name, state = newest
    except IncompleteCheckpointError as e:
        raise ConfigError(f"{said}: {e}") from None
    source = yaml.safe_load(folder.read_text(CONFIG_FILE) or "{}") or {}
    trained = (source.get("model") or {}).get("name_or_path", "tiny")
    if trained != cfg.model.name_or_path:
        raise ConfigError(f"{said}: that run trained model.name_or_path {trained!r}, this one is "
                          f"{cfg.model.name_or_path!r}; its weights fit only that model")
    if (state.base_model is not None) != cfg.lora.enabled:
        kinds = ("LoRA adapters", "the full model")
        then, now = (kinds if state.base_model is not None else kinds[::-1])
        raise ConfigError(f"{said}: that run trained {then}, this one trains {now} (lora.enabled); start from "
                          f"its exported model instead: --set model.name_or_path={where}/model")
    if cfg.lora.enabled:
        lora = source.get("lora") or {}
        for field in ("rank", "alpha", "target_modules"):
            if field in lora and lora[field] != (mine := cfg.lora.model_dump(mode="json")[field]):
                raise ConfigError(f"{said}: its adapters have lora.{field} {lora[field]!r}, this run {mine!r}")
        try:
            check_base_model(state.base_model, said, cfg.model.name_or_path, cfg.run.seed)
        except BaseModelMismatchError as e:
            raise ConfigError(str(e)) from None
    cfg.model.init_from = f"{where}/{name}"


def sync_run(cfg: Config, name: str) -> list[str]:
    """``hymt sync``: send run ``name``'s ``metrics.jsonl`` and params to MLflow where its MLflow run lacks them
    (``tracking.sync``); what the user reads. The tracking URI: ``tracking.tracking_uri`` or
    ``$MLFLOW_TRACKING_URI`` when set, else the one the run used (``run.json``), else the sqlite default."""
    import os

    import yaml

    from raytrain_hymt.errors import ConfigError
    from raytrain_hymt.storage import METRICS_FILE, RunFolder
    from raytrain_hymt.tracking.redact import redact_uri_credentials
    from raytrain_hymt.tracking.sync import sync_metrics
    from raytrain_hymt.tracking.tracker import is_outage, resolve_tracking_uri

    use_driver_env(cfg)
    folder = RunFolder(cfg.run.storage_path, name, create=False)
    if folder.read_text(METRICS_FILE) is None:
        raise ConfigError(f"sync: run {name!r} has no {METRICS_FILE} in {folder.uri} (no such run, or it logged nothing)")
    saved = json.loads(folder.read_text(RUN_FILE) or "{}")
    uri = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or saved.get("tracking_uri") \
        or resolve_tracking_uri(None, cfg.run.storage_path)
    first_config = yaml.safe_load(folder.read_text(CONFIG_FILE) or "{}") or {}
    experiment = (first_config.get("tracking") or {}).get("experiment") or cfg.tracking.experiment
    if folder.remote:
        folder.pull(METRICS_FILE)
    try:
        result = sync_metrics(folder.local / METRICS_FILE, tracking_uri=uri, experiment=experiment, run_name=name,
                              run_id=saved.get("mlflow_run_id"), run_key=saved.get("mlflow_run_key"),
                              finished=folder.read_text(SUMMARY_FILE) is not None)
    except Exception as exc:
        if not is_outage(exc):
            raise
        raise ConfigError(f"sync: the MLflow tracking server {redact_uri_credentials(uri)} does not answer "
                          f"({type(exc).__name__}); nothing was sent: run hymt sync again once it does") from exc
    if result.run_id != saved.get("mlflow_run_id"):  # later commands continue the run sync found or created
        folder.write_text(RUN_FILE, json.dumps({**saved, "mlflow_run_id": result.run_id, "tracking_uri": uri}))
    where = f"MLflow run {result.run_id} in experiment '{experiment}' at {redact_uri_credentials(uri)}"
    if not (result.metrics_sent or result.params_sent):
        return [f"sync {name}: {where} already holds everything in {METRICS_FILE}; nothing sent"]
    steps = f" (steps {result.steps[0]}-{result.steps[1]})" if result.steps else ""
    return [f"sync {name}: sent {result.metrics_sent} metric value(s){steps} and {result.params_sent} param(s) to {where}"]
