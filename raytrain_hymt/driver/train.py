"""The driver's training run: check, start or join Ray, build the datasets, run the TorchTrainer, score;
and ``hymt prepare``, which runs the same data pipeline once.

``run_training`` is a short sequence of named steps; each is a function below. The run's folder and
summary are :mod:`~raytrain_hymt.driver.runs`' room, the Ray session :mod:`~raytrain_hymt.driver.session`'s.
``storage_root`` may be a URI (``s3://``, ``gs://``, ``file://``): the run's files then go through pyarrow
(``storage.RunFolder``). When Ray Train gives up (``checkpoint.max_failures`` spent) the run ends with
``errors.TrainingFailed``, which names the original exception and the failing rank.

``prepare_dataset`` keeps the pipeline's training rows as a prepared dataset (Parquet files and a
manifest: :mod:`raytrain_hymt.data.prepared`), which ``data.prepared_path`` trains from without reading or
tokenizing the sources again.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from raytrain_hymt.config.schema import Config, deepspeed_accelerator_env
from raytrain_hymt.data.fingerprint import sources_fingerprint
from raytrain_hymt.data.pipeline import lazy_datasets
from raytrain_hymt.data.prepared import check_target, write_prepared
from raytrain_hymt.data.stats import DataStats
from raytrain_hymt.driver.runs import TrainingSummary, resolve_init_from, run_name, start_tracking
from raytrain_hymt.driver.runs import create_run_folder, discard_unstarted
from raytrain_hymt.driver.session import init_ray, use_driver_env
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.storage import CONFIG_FILE, RUN_FILE, SUMMARY_FILE, RunFolder, folder_problem, is_uri

log = logging.getLogger("raytrain_hymt")


def run_training(cfg: Config, *, datasets=None, callbacks=(), parent_run_id: str | None = None) -> TrainingSummary:
    """Train (or resume) the run ``cfg`` describes, export it, and return its summary.

    A search's trial passes the ``(train, val, stats)`` the search built once (``datasets``), Ray Train
    callbacks (Tune's reporting) and its search's MLflow run (``parent_run_id``).
    """
    started = time.time()
    folder, fingerprint = open_run(cfg)
    try:
        start_session(cfg, check_resources=datasets is None)  # a search checked the cluster once for its trials
        create_run_folder(folder, cfg)
        tracker, uri = track_run(cfg, folder, parent_run_id)
    except BaseException:
        discard_unstarted(folder)
        raise
    try:
        train, val, stats = datasets or build_run_datasets(cfg, tracker)
        loop_inputs = {
            "config": cfg.model_dump(mode="json"), "train_rows": stats.train_rows,
            "tracking_run_id": tracker.run_id, "tracking_run_key": tracker.run_key, "tracking_uri": uri,
            "run_dir": str(folder.local),
            "data_fingerprint": fingerprint,
            "submission": uuid.uuid4().hex,  # a restart within this call is not a resume (RunState.submission)
        }
        result = fit_workers(cfg, train, val, loop_inputs, callbacks)
        model_dir = locate_model(cfg, folder, tracker)
        steps = int((result.metrics or {}).get("step", 0))
        test_scores = score_test_set(cfg, folder, tracker, model_dir, steps)
        summary = summarise(cfg, folder, result, model_dir, test_scores, uri, tracker.run_id, started)
        tracker.finish("FINISHED")
    except BaseException as e:
        tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        discard_unstarted(folder)
        stop = ctrl_c_before_fit(e, cfg)
        if stop:
            raise stop from None
        raise
    folder.write_text(SUMMARY_FILE, json.dumps(asdict(summary), indent=1))
    return summary


def open_run(cfg: Config) -> tuple[RunFolder, dict]:
    """Check everything the driver can before Ray starts, name the run and find its folder, which a new run
    gets only once Ray started (:func:`~raytrain_hymt.driver.runs.create_run_folder`): a start that fails
    leaves no folder that would hold the name to a config that never trained.

    A re-submission that would train something else, or a resume on changed data, stops here.
    Returns the folder and the data fingerprint the workers record in every checkpoint.
    """
    from raytrain_hymt.driver.resume import check_resume_data, keep_first_config

    use_driver_env(cfg)
    preflight(cfg)
    cfg.run.name = run_name(cfg)
    resolve_init_from(cfg)  # before config.yaml is written: it keeps the checkpoint, not a run's newest
    folder = RunFolder(cfg.run.storage_path, cfg.run.name, create=False)  # made once Ray started: create_run_folder
    if folder.read_text(CONFIG_FILE) is not None:
        keep_first_config(folder, cfg)  # a re-submission, checked against the config it started with
    return folder, check_resume_data(cfg, folder)


def start_session(cfg: Config, check_resources: bool = True) -> None:
    """Start or join Ray; then fail fast (a local Ray) or warn (a cluster) when the workers cannot fit."""
    from raytrain_hymt.driver.session import check_cluster_resources

    started_locally = init_ray(cfg)
    if check_resources:
        check_cluster_resources(cfg, started_locally)


def track_run(cfg: Config, folder: RunFolder, parent_run_id: str | None):
    """The run's MLflow run, continued when a re-submitted job finds its ``run.json``; ``(tracker, uri)``."""
    folder.pull(RUN_FILE)
    tracker, uri = start_tracking(cfg, folder.local, parent_run_id=parent_run_id)
    if uri:  # the run's key, even while the server is down
        folder.push(RUN_FILE)
    return tracker, uri


def build_run_datasets(cfg: Config, tracker):
    """The run's ``(train, val, stats)`` datasets (Ray Data), with the statistics logged at step 0."""
    from raytrain_hymt.data.pipeline import build_datasets

    train, val, stats = build_datasets(cfg)
    log.info(stats.summary())
    tracker.log_metrics(stats.as_metrics(), step=0)
    return train, val, stats


def fit_workers(cfg: Config, train, val, loop_inputs: dict, callbacks=()):
    """Run the TorchTrainer to its end, drawing rank 0's progress; Ray Train's result.

    A spent failure budget becomes one ``TrainingFailed`` that names the failing rank and cause.
    """
    from ray.train import TrainingFailedError

    from raytrain_hymt.console.progress import Watcher
    from raytrain_hymt.console.quiet import verbose
    from raytrain_hymt.driver.resume import fit
    from raytrain_hymt.errors import budget_spent

    watcher = None if verbose() else Watcher()  # verbose: rank 0's own lines are forwarded instead
    loop_inputs = {**loop_inputs, "progress_board": watcher.name if watcher else None}
    try:
        return fit(build_trainer(cfg, train, val, loop_inputs, callbacks), cfg.run.storage_path, cfg.run.name)
    except TrainingFailedError as e:
        raise budget_spent(e, cfg.checkpoint.max_failures) from e
    finally:
        if watcher:
            watcher.close()


def locate_model(cfg: Config, folder: RunFolder, tracker) -> str | None:
    """Where the workers exported the model (``worker.Worker.export``); the driver only says where."""
    from raytrain_hymt.train.worker import MODEL_DIR

    if not cfg.run.export:
        return None
    model_dir = folder.location(MODEL_DIR)
    tracker.set_tags({"model_dir": model_dir})
    if cfg.tracking.log_model:
        if folder.remote:
            log.warning("tracking.log_model: the model is in %s, not uploaded again to MLflow", model_dir)
        else:
            tracker.log_artifact(model_dir, "model")
    return model_dir


def score_test_set(cfg: Config, folder: RunFolder, tracker, model_dir: str | None, steps: int) -> dict | None:
    """BLEU/chrF/chrF++/TER of the exported model on ``eval.test_set``, or None (no test set, no export).

    A failed evaluation is a warning: the trained model is safe, and ``hymt evaluate`` scores it again.
    """
    from raytrain_hymt.driver.evaluate import evaluate_model, log_result

    if not (cfg.eval.test_set and model_dir):  # a search's trials export nothing
        return None
    try:
        # The training workers are gone: the translating replicas get their GPUs. model_dir, not the
        # driver's local copy: replicas may run on other nodes (a URI reaches them).
        test = evaluate_model(cfg, model_dir, folder.local / "eval", step=steps)
    except Exception as e:  # noqa: BLE001 - the trained model is safe; scoring can be redone
        log.warning("evaluation on %s failed (%s: %s); the run is kept, score it with: "
                    "hymt evaluate --name %s", cfg.eval.test_set, type(e).__name__, e, cfg.run.name)
        return None
    log_result(tracker, test, steps)
    folder.push("eval")
    return {"test_set": test.test_set, "scores": test.scores}


def summarise(cfg: Config, folder: RunFolder, result, model_dir: str | None, test_scores: dict | None,
              uri: str | None, mlflow_run_id: str | None, started: float) -> TrainingSummary:
    """What the user reads at the end, and what ``summary.json`` keeps."""
    from raytrain_hymt.train.loop import STARTED_AT

    metrics = result.metrics or {}
    return TrainingSummary(
        name=cfg.run.name, run_dir=folder.uri, checkpoint=result.checkpoint.path, model_dir=model_dir,
        steps=int(metrics.get("step", 0)), train_loss=float(metrics.get("train_loss", float("nan"))),
        val_loss=metrics.get("val_loss"), wall_time_s=time.time() - started, tracking_uri=uri,
        mlflow_run_id=mlflow_run_id, mlflow_experiment=cfg.tracking.experiment if uri else None,
        test_scores=test_scores, started_at=int(metrics.get(STARTED_AT, 0)),
    )


def ctrl_c_before_fit(e: BaseException, cfg: Config):
    """For a Ctrl-C before Ray Train's fit (``interrupt.fit`` raises its own), the ``Interrupted`` that
    names the last checkpoint to resume from; None for any other exception."""
    from raytrain_hymt.driver.resume import Interrupted, latest_checkpoint

    if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
        return Interrupted(cfg.run.name, latest_checkpoint(cfg.run.storage_path, cfg.run.name))
    return None


def build_trainer(cfg: Config, train, val, loop_inputs: dict, callbacks=(), loop=None, train_shard: bool = False):
    """The TorchTrainer of a run; ``loop``: the per-worker function (default :func:`~raytrain_hymt.train.loop.train_loop`);
    ``train_shard``: the loop reads ``ray.train.get_dataset_shard("train")`` (the benchmark's loop does)."""
    import ray.train
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchTrainer

    from raytrain_hymt.data.blocks import train_blocks, val_blocks
    from raytrain_hymt.train.faults import FORWARDED_ENV
    from raytrain_hymt.train.loop import train_loop

    # GPU: expandable segments keep the caching allocator's fragmentation out of the peak a card must hold
    # (LoRA preset at 8.03 B on one H200: 24.9 GiB reserved for 21.3 allocated without them).
    env = ({"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
           if cfg.scaling.use_gpu else deepspeed_accelerator_env(use_gpu=False))
    if os.environ.get("HYMT_VERBOSE"):
        env["HYMT_VERBOSE"] = "1"
    env.update({k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)})  # tests' fault injection
    env.update(cfg.scaling.env)
    shard = {}
    if train_shard:
        ordered = ray.train.DataConfig(datasets_to_split=[], execution_options={"train": ExecutionOptions(preserve_order=True)})
        shard = {"datasets": {"train": train}, "dataset_config": ordered}
    return TorchTrainer(
        loop or train_loop,
        # The workers read the rows themselves (data.blocks): each rank its own training rows, every rank
        # all validation rows. The blocks' object refs travel inside the config (Ray Train puts it in the
        # object store whole).
        train_loop_config={**loop_inputs, "train_blocks": train_blocks(cfg, train), "val_blocks": val_blocks(cfg, val)},
        scaling_config=scaling_config(cfg),
        **shard,
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            worker_runtime_env={"env_vars": env},
            callbacks=list(callbacks),
        ),
    )


def scaling_config(cfg: Config):
    """Ray Train's ``ScalingConfig`` of a run (elastic when ``scaling.min_workers`` is set)."""
    import ray.train

    return ray.train.ScalingConfig(
        num_workers=_ray_num_workers(cfg), use_gpu=cfg.scaling.use_gpu,
        resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
        elastic_resize_monitor_interval_s=cfg.scaling.elastic_resize_monitor_interval_s,
    )


def _ray_num_workers(cfg: Config) -> int | tuple[int, int]:
    """Ray Train's ``num_workers``: a count, or ``(min, max)`` for an elastic run (``scaling.min_workers``)."""
    s = cfg.scaling
    return s.num_workers if s.min_workers is None else (s.min_workers, s.num_workers)


def preflight(cfg: Config) -> None:
    """Mistakes the config alone cannot see, caught on the driver before Ray starts or data is read."""
    from raytrain_hymt.data.preflight import check_inputs

    check_inputs(cfg)  # typos in paths, formats, language codes: before a run folder or Ray exists
    if problem := folder_problem("run.storage_root", cfg.run.storage_path, "a folder per run"):
        raise ConfigError(problem)
    from raytrain_hymt.train.engine import build_ds_config

    # A missing or contradicting deepspeed.config_file would otherwise fail on every worker, after the
    # data pipeline ran, once per allowed restart.
    build_ds_config(cfg, cfg.scaling.num_workers, cfg.scaling.use_gpu)
    if is_uri(cfg.run.storage_path) and cfg.tracking.enabled and not (
        cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    ):
        raise ConfigError(
            f"run.storage_root is {cfg.run.storage_root}: the embedded sqlite MLflow store needs a local folder; "
            "set tracking.tracking_uri (or MLFLOW_TRACKING_URI) to an MLflow server, or tracking.enabled=false"
        )
    from raytrain_hymt.data.preflight import default_eval_directions

    # Resolved here, before config.yaml is written: the workers, a resume and hymt evaluate see the same list.
    cfg.eval.directions = default_eval_directions(cfg, required=bool(cfg.eval.test_set))
    if cfg.eval.test_set:
        from raytrain_hymt.evaluation.scoring import load_test_set, plan_rows

        if not cfg.run.export:
            raise ConfigError("eval.test_set scores the exported model at the end of a run: it needs run.export: true")
        # A wrong folder or direction would otherwise surface after hours of training.
        plan_rows(load_test_set(cfg.eval.test_set), cfg.eval.directions, cfg.eval.max_sentences)


def prepare_dataset(cfg: Config, out: str, overwrite: bool = False) -> DataStats:
    """Read, clean, tokenize, split, order and pack the configured sources and publish them as a
    prepared dataset in ``out`` (see the module docstring); ``overwrite`` replaces what ``out`` holds."""
    if cfg.data.prepared_path:
        raise ConfigError("data.prepared_path is set: prepare reads data.sources; unset it to prepare again")
    if not is_uri(out):
        out = str(Path(out).expanduser().resolve())
    check_target(out, overwrite)  # before Ray starts or any file is read
    fingerprint = sources_fingerprint(cfg)
    if not is_uri(out):
        Path(out).mkdir(parents=True, exist_ok=True)
    init_ray(cfg)
    train, val, stats = lazy_datasets(cfg)
    return write_prepared(cfg, out, train, val, stats, fingerprint)
