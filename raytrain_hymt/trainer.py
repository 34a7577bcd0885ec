"""The driver: start or join Ray, build the datasets, run the TorchTrainer, export, summarise.

A run lives in ``<storage_root>/<name>/``: Ray's checkpoints (``checkpoint_step*``), ``run.json`` (the
MLflow run id, so a re-submitted job continues the same MLflow run), ``config.yaml``, ``model/`` (the
exported Hugging Face folder) and ``summary.json`` (written last; a finished run prints it and exits).
``storage_root`` may be a URI (``s3://``, ``gs://``, ``file://``): these files then go through pyarrow
(``storage.RunFolder``). When Ray Train gives up (``checkpoint.max_failures`` spent) the run ends with
``errors.TrainingFailed``, which names the original exception and the failing rank.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from raytrain_hymt.config import Config, to_yaml

log = logging.getLogger("raytrain_hymt")

SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"


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

    def lines(self) -> list[str]:
        """What the user reads at the end of a run."""
        val = f", validation loss {self.val_loss:.4f}" if self.val_loss is not None else ""
        out = [
            f"run {self.name}: {self.steps} steps in {self.wall_time_s:.0f} s, train loss {self.train_loss:.4f}{val}",
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


def init_ray(cfg: Config) -> bool:
    """Join the cluster in ``RAY_ADDRESS`` (e.g. under ``ray job submit``) or start a local Ray.

    Returns True when this call started a local Ray (no other node can ever join it), False when it
    joined a cluster or Ray was already initialized.
    """
    import ray

    from raytrain_hymt.quiet import quiet_ray, ray_init_kwargs

    quiet_ray(driver=True)
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**ray_init_kwargs())
        return False
    # 2 training workers plus the tokenizer actors need more logical CPUs than a 2-core machine has
    # (FACTS.md: on 2 logical CPUs the actors never start). Logical CPUs are only a scheduling count.
    want = cfg.scaling.local_num_cpus or max(4, os.cpu_count() or 1, int(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker) + cfg.data.tokenize_actors)
    ray.init(address="local", num_cpus=want, include_dashboard=False, **ray_init_kwargs())
    return True


def start_tracking(cfg: Config, run_dir: Path, parent_run_id: str | None = None, new_measurements: bool = False):
    """Create or resume (id in ``<run_dir>/run.json``) the MLflow run of ``run_dir``; log its config.

    Returns ``(tracker, tracking_uri)``; ``(NullTracker, None)`` when tracking is off. ``parent_run_id``
    makes it a child run (a search's trial); ``new_measurements``: see ``Tracker.start``.
    """
    from raytrain_hymt.tracking import make_tracker, resolve_tracking_uri

    if not cfg.tracking.enabled:
        return make_tracker(False), None
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, cfg.run.storage_path)
    saved = json.loads((run_dir / RUN_FILE).read_text()) if (run_dir / RUN_FILE).exists() else {}
    tracker = make_tracker(
        True, tracking_uri=uri, experiment=cfg.tracking.experiment, run_name=cfg.run.name,
        run_id=saved.get("mlflow_run_id"), local_dir=run_dir, tensorboard=False,
        parent_run_id=parent_run_id, retry_interval_s=cfg.tracking.retry_interval_s,
        new_measurements=new_measurements,
    )
    (run_dir / RUN_FILE).write_text(json.dumps({"mlflow_run_id": tracker.run_id, "tracking_uri": uri}))
    tracker.log_params(cfg.model_dump(mode="json"))  # flattened and redacted by the tracker
    tracker.log_text(to_yaml(cfg), "config.yaml")
    return tracker, uri


def _trainer(cfg: Config, train, val, loop_inputs: dict, callbacks=(), loop=None):
    """The TorchTrainer of a run; ``loop``: the worker function (default ``train_loop``; benchmarks)."""
    import ray.train
    from ray.data import ExecutionOptions
    from ray.train.torch import TorchTrainer

    from raytrain_hymt.faults import FORWARDED_ENV
    from raytrain_hymt.train_loop import train_loop

    # GPU: expandable segments keep the caching allocator's fragmentation out of the peak a card must hold
    # (LoRA preset at 8.03 B on one H200: 24.9 GiB reserved for 21.3 allocated without them).
    env = ({"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
           if cfg.scaling.use_gpu else {"DS_ACCELERATOR": "cpu"})
    if os.environ.get("HYMT_VERBOSE"):
        env["HYMT_VERBOSE"] = "1"
    env.update({k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)})  # tests' fault injection
    env.update(cfg.scaling.env)
    ordered = ExecutionOptions(preserve_order=True)
    return TorchTrainer(
        loop or train_loop,
        train_loop_config=loop_inputs,
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
        ),
        datasets={"train": train, "val": val},
        # Every worker reads the whole ordered stream and takes its slice (train_loop.rank_slice).
        dataset_config=ray.train.DataConfig(datasets_to_split=[], execution_options={"train": ordered, "val": ordered}),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=cfg.checkpoint.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep),
            worker_runtime_env={"env_vars": env},
            callbacks=list(callbacks),
        ),
    )


def use_driver_env(cfg: Config) -> None:
    """Put ``scaling.env`` into this (the driver's) environment.

    The driver reads and writes the run folder itself, and a local Ray it starts passes its environment on
    to every process (Ray Train's controller too), so an object store's endpoint has to be in place first.
    """
    os.environ.update(cfg.scaling.env)


def finished_summary(cfg: Config) -> TrainingSummary | None:
    """The summary of a run of this name that already finished, or None."""
    from raytrain_hymt.storage import RunFolder

    use_driver_env(cfg)
    if not cfg.run.name:
        return None
    text = RunFolder(cfg.run.storage_path, cfg.run.name, create=False).read_text(SUMMARY_FILE)
    return TrainingSummary(**json.loads(text)) if text else None


def preflight(cfg: Config) -> None:
    """Mistakes the config alone cannot see, caught on the driver before Ray starts or data is read."""
    from raytrain_hymt.data.preflight import check_inputs

    check_inputs(cfg)  # typos in paths, formats, language codes: before a run folder or Ray exists
    from raytrain_hymt.config import ConfigError
    from raytrain_hymt.engine import build_ds_config
    from raytrain_hymt.storage import is_uri

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
    if cfg.eval.test_set:
        from raytrain_hymt.evaluate import load_test_set, plan_rows

        if not cfg.run.export:
            raise ConfigError("eval.test_set scores the exported model at the end of a run: it needs run.export: true")
        # A wrong folder or direction would otherwise surface after hours of training.
        plan_rows(load_test_set(cfg.eval.test_set), cfg.eval.directions, cfg.eval.max_sentences)


def run_training(cfg: Config, *, datasets=None, callbacks=(), parent_run_id: str | None = None) -> TrainingSummary:
    """Train (or resume) the run ``cfg`` describes, export it, and return its summary.

    A search's trial passes the ``(train, val, stats)`` the search built once (``datasets``), Ray Train
    callbacks (Tune's reporting) and its search's MLflow run (``parent_run_id``).
    """
    from ray.train import TrainingFailedError

    from raytrain_hymt.data import progress as data_progress
    from raytrain_hymt.data.pipeline import build_datasets
    from raytrain_hymt.errors import budget_spent
    from raytrain_hymt.evaluate import evaluate_model, log_result
    from raytrain_hymt.interrupt import Interrupted, fit, latest_checkpoint
    from raytrain_hymt.resume import keep_first_config
    from raytrain_hymt.progress import Watcher
    from raytrain_hymt.quiet import verbose
    from raytrain_hymt.resources import check_cluster_resources
    from raytrain_hymt.resume_data import check_resume_data

    from raytrain_hymt.storage import RunFolder
    from raytrain_hymt.train_loop import MODEL_DIR

    started = time.time()
    use_driver_env(cfg)
    preflight(cfg)
    cfg.run.name = run_name(cfg)
    folder = RunFolder(cfg.run.storage_path, cfg.run.name)
    # On a URI storage root, run_dir is the driver's staging folder; the files that matter are pushed.
    run_dir = folder.local
    keep_first_config(folder, cfg)  # a re-submission that would train something else stops here
    fingerprint = check_resume_data(cfg, folder)  # a resume on changed data stops here, before Ray
    started_locally = init_ray(cfg)
    if datasets is None:  # a search's trial: run_search checked the cluster once for all its trials
        check_cluster_resources(cfg, started_locally)
    folder.pull(RUN_FILE)  # a re-submitted job continues the MLflow run of the first one
    tracker, uri = start_tracking(cfg, run_dir, parent_run_id=parent_run_id)
    if tracker.run_id:
        folder.push(RUN_FILE)
    try:
        if datasets is None:  # a search's trial gets the datasets its search built
            with data_progress.showing():
                datasets = build_datasets(cfg)
        train, val, stats = datasets
        log.info(stats.summary())
        tracker.log_metrics(stats.as_metrics(), step=0)
        loop_inputs = {
            "config": cfg.model_dump(mode="json"), "train_rows": stats.train_rows,
            "tracking_run_id": tracker.run_id, "tracking_uri": uri, "run_dir": str(run_dir),
            "data_fingerprint": fingerprint,
        }
        watcher = None if verbose() else Watcher()  # verbose: rank 0's own lines are forwarded instead
        loop_inputs["progress_board"] = watcher.name if watcher else None
        try:
            result = fit(_trainer(cfg, train, val, loop_inputs, callbacks), cfg.run.storage_path, cfg.run.name)
        except TrainingFailedError as e:
            raise budget_spent(e, cfg.checkpoint.max_failures) from e
        finally:
            if watcher:
                watcher.close()
        model_dir = None
        if cfg.run.export:  # the workers wrote it (train_loop.Worker.export); the driver only says where
            model_dir = folder.location(MODEL_DIR)
            if tracker.run_id:
                tracker.set_tags({"model_dir": model_dir})
            if cfg.tracking.log_model:
                if folder.remote:
                    log.warning("tracking.log_model: the model is in %s, not uploaded again to MLflow", model_dir)
                else:
                    tracker.log_artifact(model_dir, "model")
        metrics = result.metrics or {}
        steps = int(metrics.get("step", 0))
        test_scores = None
        if cfg.eval.test_set and model_dir:  # a search's trials export nothing
            try:
                # The training workers are gone: the translating replicas get their GPUs. model_dir, not the
                # driver's local copy: replicas may run on other nodes (a URI reaches them).
                test = evaluate_model(cfg, model_dir, run_dir / "eval", step=steps)
            except Exception as e:  # noqa: BLE001 - the trained model is safe; scoring can be redone
                log.warning("evaluation on %s failed (%s: %s); the run is kept, score it with: "
                            "hymt evaluate --name %s", cfg.eval.test_set, type(e).__name__, e, cfg.run.name)
            else:
                log_result(tracker, test, steps)
                folder.push("eval")
                test_scores = {"test_set": test.test_set, "scores": test.scores}
        summary = TrainingSummary(
            name=cfg.run.name, run_dir=folder.uri, checkpoint=result.checkpoint.path, model_dir=model_dir,
            steps=steps, train_loss=float(metrics.get("train_loss", float("nan"))),
            val_loss=metrics.get("val_loss"), wall_time_s=time.time() - started, tracking_uri=uri,
            mlflow_run_id=tracker.run_id, mlflow_experiment=cfg.tracking.experiment if uri else None,
            test_scores=test_scores,
        )
        tracker.finish("FINISHED")
    except BaseException as e:
        tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):  # Ctrl-C before fit()
            raise Interrupted(cfg.run.name, latest_checkpoint(cfg.run.storage_path, cfg.run.name)) from None
        raise
    folder.write_text(SUMMARY_FILE, json.dumps(asdict(summary), indent=1))
    return summary
