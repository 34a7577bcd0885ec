"""Hyperparameter search with Ray Tune: every trial is a full training run of the project's own loop.

Ray 2.60's pattern (Train V2): a ``tune.Tuner`` over a driver function that builds one ``TorchTrainer``
per trial (``driver.train.run_training``) with Tune's ``TuneReportCallback``; the workers report the
validation loss every ``eval.every_steps`` and ASHA stops the trials that trail. The datasets are built
once, here, and handed to every trial (``tune.with_parameters``), so no trial reads or tokenizes again.

A search lives in ``<storage_root>/<name>/``: ``tune/`` (Tune's experiment state: running the same
command again continues an interrupted search), ``trial-<id>/`` (each trial's training run: checkpoints,
``run.json``, ``metrics.jsonl``), ``trials.csv``, ``best.yaml`` (a preset with the best values) and
``run.json`` (the MLflow parent run; every trial is a child run of it).

The plan of a hyperparameter search (``hymt tune``) and its result table: the search space, each
trial's config and resources, how many trials run at once, the steps a trial runs, the best trial and the
preset that holds its values. No Ray here: :mod:`raytrain_hymt.driver.tune` runs the search.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from raytrain_hymt.config.schema import Config, flatten, to_yaml
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.storage import CONFIG_FILE

log = logging.getLogger("raytrain_hymt")

METRIC = "val_loss"
TIME_ATTR = "step"
TUNE_DIR = "tune"
TRIALS_FILE = "trials.csv"
BEST_PRESET = "best.yaml"
STOPPED_EARLY_TAG = "tune.stopped_early"


@dataclass
class SearchResult:
    """Where a search's results are."""

    name: str
    search_dir: str
    rows: list[TrialRow]
    best: TrialRow | None
    best_preset: str | None
    planned_steps: int
    finished: bool
    """False when the search was interrupted (run the same command again to continue it)."""
    wall_time_s: float
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    mlflow_experiment: str | None = None

    def lines(self) -> list[str]:
        """What the user reads at the end of a search."""
        state = "finished" if self.finished else "INTERRUPTED (run the same command again to continue)"
        trials = f"{len(self.rows)} trial{'' if len(self.rows) == 1 else 's'}"
        out = [f"search {self.name}: {trials} of up to {self.planned_steps} steps, "
               f"{self.wall_time_s:.0f} s, {state}", *("  " + line for line in table_lines(self.rows))]
        if self.best is not None:
            out += [
                f"  best trial:   {self.best.trial_id} "
                f"({', '.join(f'{k}={fmt_value(v)}' for k, v in self.best.params.items())}), "
                f"validation loss {self.best.val_loss:.4f}",
                f"  checkpoint:   {self.best.checkpoint}  (hymt export <it> <folder> makes a model)",
            ]
        if self.best_preset:
            out.append(f"  best preset:  {self.best_preset}  (hymt train --config {self.best_preset})")
        if self.mlflow_run_id:
            out.append(f"  MLflow run:   {self.mlflow_run_id} (parent of the trials' runs) in experiment "
                       f"'{self.mlflow_experiment}' at {self.tracking_uri}")
            if self.tracking_uri and self.tracking_uri.startswith("sqlite:"):
                out.append(f"  open the UI:  mlflow ui --backend-store-uri {self.tracking_uri}")
        return out


def _run_trial(params: dict, *, base: dict, datasets, search_dir: str, tracking_uri: str | None,
               parent_run_id: str | None) -> None:
    """One trial (runs in a Tune trial actor): the project's full training run with ``params``."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_hymt.driver.train import run_training

    cfg = trial_config(Config.model_validate(base), params)
    # Trials live in the search's folder; their MLflow runs in the search's store (not one per folder).
    cfg.run.storage_root = search_dir
    cfg.run.name = f"trial-{ray.tune.get_context().get_trial_id()}"
    cfg.run.export = False
    cfg.tracking.tracking_uri = tracking_uri
    run_training(cfg, datasets=datasets, callbacks=[TuneReportCallback()], parent_run_id=parent_run_id)


def _tuner(cfg: Config, search_dir: Path, trainable, total_steps: int, concurrency: int):
    """A new Tuner, or the interrupted one restored from ``<search_dir>/tune``."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from raytrain_hymt.console.quiet import tune_verbosity

    t = cfg.tune
    path = str(search_dir / TUNE_DIR)
    if tune.Tuner.can_restore(path):
        log.info("continuing the search saved in %s", path)
        return tune.Tuner.restore(path, trainable=trainable, resume_unfinished=True, resume_errored=True)
    space = {
        section: {name: tune.grid_search(spec) if isinstance(spec, list) else tune.loguniform(*spec[1:])
                  for name, spec in fields.items()}
        for section, fields in search_dimensions(cfg).items()
    }
    grace = min(t.grace_period_steps or cfg.eval.every_steps, total_steps)
    scheduler = ASHAScheduler(time_attr=TIME_ATTR, max_t=total_steps, grace_period=grace,
                              reduction_factor=t.reduction_factor)
    return tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            metric=METRIC, mode="min", scheduler=scheduler, num_samples=t.num_samples,
            # The concurrency limit goes to the generator: Tune ignores max_concurrent_trials next to one.
            search_alg=BasicVariantGenerator(random_state=t.seed, max_concurrent=concurrency),
        ),
        run_config=tune.RunConfig(name=TUNE_DIR, storage_path=str(search_dir), verbose=tune_verbosity(),
                                  callbacks=[_trial_lines(total_steps)]),
    )


def _trial_lines(total_steps: int):
    """A Tune callback that logs one line per trial that ends: finished, stopped early by ASHA, or failed
    (Tune's own console is off at default verbosity: ``console.quiet.quiet_tune``). Built here so that
    importing this module does not import Ray; Tune saves it with the search (cloudpickle) for a restore."""
    from ray import tune

    class TrialLines(tune.Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            result = trial.last_result or {}
            steps = int(result.get(TIME_ATTR, 0))
            log.info("trial %s %s", trial.trial_id,
                     trial_line(flatten(trial.config), result.get(METRIC), steps, total_steps))

        def on_trial_error(self, iteration, trials, trial, **info):
            log.warning("trial %s failed (%s): see %s", trial.trial_id,
                        ", ".join(f"{k}={fmt_value(v)}" for k, v in flatten(trial.config).items()),
                        trial.error_file)

    return TrialLines()


def trial_line(params: Mapping, val_loss: float | None, steps: int, total_steps: int) -> str:
    """How a trial ended, after its id: ``done: optim.lr=0.001, val_loss 6.1234 after 8 steps``, or ``stopped:
    ..., val_loss 8.3424 after 2 of 8 steps`` (ASHA stopped it). The trials a Ctrl-C stops get no line: the
    search continues them when it runs again."""
    val = f"{val_loss:.4f}" if val_loss is not None else "-"
    done = steps >= total_steps
    return (f"{'done' if done else 'stopped'}: {', '.join(f'{k}={fmt_value(v)}' for k, v in params.items())}, "
            f"val_loss {val} after {steps}{'' if done else f' of {total_steps}'} steps")


def _rows(grid, search_dir: Path, total_steps: int) -> list[TrialRow]:
    """The table rows of a ``ResultGrid``: metrics and error from each ``Result``; the trial's id, config
    and status from the saved experiment state (``ExperimentAnalysis``), matched by trial folder, since a
    trial that never reported has neither id nor config in its ``Result``. The status is the saved one on
    purpose: after Ctrl+C Tune stops the running trials and calls them TERMINATED in memory (as it does a
    trial ASHA stopped), while the saved state, which a restore continues, keeps them unfinished."""
    from ray.tune import ExperimentAnalysis

    saved = {Path(t.path).name: t for t in ExperimentAnalysis(grid.experiment_path).trials}
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        trial = saved.get(Path(result.path).name)
        trial_id = trial.trial_id if trial is not None else metrics["trial_id"]
        steps = int(metrics.get(TIME_ATTR, 0))
        if result.error is not None:
            status = f"error: {type(result.error).__name__}"
        elif trial is None or trial.status != "TERMINATED":  # not saved as finished: a restore runs it
            status = "unfinished"
        else:
            status = "done" if steps >= total_steps else "stopped"
        run_dir = search_dir / f"trial-{trial_id}"
        saved_run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
        val = metrics.get(METRIC)
        rows.append(TrialRow(
            trial_id=trial_id, params=flatten(trial.config if trial is not None else result.config or {}),
            val_loss=float(val) if val is not None else None, steps=steps, stopped_early=status == "stopped",
            status=status, run_dir=str(run_dir), checkpoint=metrics.get("checkpoint_path"),
            mlflow_run_id=saved_run.get("mlflow_run_id"),
        ))
    return rows


def _close_child_runs(cfg: Config, rows: list[TrialRow], uri: str | None) -> None:
    """Give every trial's MLflow run its final status: a trial ASHA stopped was killed mid-training,
    so nothing in it could end its run (``KILLED``, tag ``tune.stopped_early=true``)."""
    from raytrain_hymt.tracking.tracker import Tracker

    for row in rows:
        if not row.mlflow_run_id or uri is None or row.status == "unfinished":
            continue
        status = {"done": "FINISHED", "stopped": "KILLED"}.get(row.status, "FAILED")
        child = Tracker.start(tracking_uri=uri, experiment=cfg.tracking.experiment, run_name=Path(row.run_dir).name,
                              run_id=row.mlflow_run_id, local_dir=row.run_dir,
                              retry_interval_s=cfg.tracking.retry_interval_s)
        child.set_tags({STOPPED_EARLY_TAG: str(row.stopped_early).lower()})
        child.finish(status)


def run_search(cfg: Config) -> SearchResult:
    """Run (or continue) the search ``cfg.tune`` describes; print-ready results, best preset written."""
    import ray
    from ray import tune

    from raytrain_hymt.console.quiet import quiet_tune
    from raytrain_hymt.data.pipeline import build_datasets
    from raytrain_hymt.driver.runs import run_name, start_tracking
    from raytrain_hymt.driver.session import check_cluster_resources, check_state_api, init_ray
    from raytrain_hymt.driver.train import preflight
    from raytrain_hymt.storage import is_uri

    started = time.time()
    for point in grid_points(cfg):  # every trial's config is valid, before anything starts
        trial_config(cfg, point)
    preflight(cfg)
    if is_uri(cfg.run.storage_path):  # checked before Path() folds "s3://" into "s3:/"
        raise NotImplementedError("searches need a local or shared-filesystem run.storage_root, not a URI")
    cfg.run.name = run_name(cfg)
    search_dir = Path(cfg.run.storage_path, cfg.run.name)
    search_dir.mkdir(parents=True, exist_ok=True)
    (search_dir / CONFIG_FILE).write_text(to_yaml(cfg))
    # One trial's worker group must fit before the datasets are built (its driver's CPUs are checked by
    # max_concurrent_trials, which needs the cluster anyway).
    check_cluster_resources(cfg, init_ray(cfg))
    check_state_api()
    tracker, uri = start_tracking(cfg, search_dir)
    try:
        train, val, stats = build_datasets(cfg)
        log.info(stats.summary())
        tracker.log_metrics(stats.as_metrics(), step=0)
        total = planned_steps(cfg, stats.train_rows)
        concurrency = max_concurrent_trials(ray.cluster_resources(), cfg)
        log.info("search %s: %d trials of up to %d steps, %d at a time (each holds %s)", cfg.run.name,
                 num_trials(cfg), total, concurrency, trial_resources(cfg))
        trainable = tune.with_resources(
            tune.with_parameters(_run_trial, base=cfg.model_dump(mode="json"), datasets=(train, val, stats),
                                 search_dir=str(search_dir), tracking_uri=uri, parent_run_id=tracker.run_id),
            {"cpu": cfg.tune.driver_cpus},
        )
        with quiet_tune():
            grid = _tuner(cfg, search_dir, trainable, total, concurrency).fit()
        rows = _rows(grid, search_dir, total)
        finished = all(r.status != "unfinished" for r in rows) and len(rows) == num_trials(cfg)
        if not any(r.status in ("done", "stopped") for r in rows) and grid.errors:
            raise grid.errors[0]
        _close_child_runs(cfg, rows, uri)
        result = _summarise(cfg, search_dir, rows, total, finished, started, tracker, uri)
        tracker.finish("FINISHED" if finished else "KILLED")
    except BaseException:
        tracker.finish("FAILED")
        raise
    return result


def _summarise(cfg, search_dir: Path, rows, total, finished, started, tracker, uri) -> SearchResult:
    """Write and log the table and the best preset; build the :class:`SearchResult`."""
    best = best_trial(rows)
    preset = None
    table = table_lines(rows)
    with open(search_dir / TRIALS_FILE, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])) if rows else ["trial_id"])
        writer.writeheader()
        writer.writerows(asdict(r) | {"params": json.dumps(r.params)} for r in rows)
    tracker.log_text("\n".join(table) + "\n", "trials.txt")
    tracker.log_artifact(search_dir / TRIALS_FILE)
    if best is not None and finished:
        preset = str(search_dir / BEST_PRESET)
        text = best_preset_yaml(cfg, best, cfg.run.name)
        Path(preset).write_text(text)
        tracker.log_text(text, BEST_PRESET)  # log_text redacts (the config may hold a URI's password)
        tracker.set_tags({"best.trial": best.trial_id, "best.checkpoint": best.checkpoint or "",
                          **{f"best.{k}": str(v) for k, v in best.params.items()}})
        tracker.log_metrics({"best/val_loss": best.val_loss}, step=best.steps)
    return SearchResult(
        name=cfg.run.name, search_dir=str(search_dir), rows=rows, best=best, best_preset=preset,
        planned_steps=total, finished=finished, wall_time_s=time.time() - started, tracking_uri=uri,
        mlflow_run_id=tracker.run_id, mlflow_experiment=cfg.tracking.experiment if uri else None,
    )


def search_dimensions(cfg: Config) -> dict[str, Any]:
    """The searched fields as nested ``{section: {field: spec}}``; a spec is a list (grid) or a
    ``("loguniform", low, high)`` tuple."""
    t = _tune_section(cfg)
    dims: dict[str, Any] = {"optim": {"lr": list(t.lr_grid) if t.lr_grid else ("loguniform", *t.lr_range)}}
    if t.warmup_steps:
        dims["optim"]["warmup_steps"] = list(t.warmup_steps)
    if t.lora_rank:
        dims["lora"] = {"rank": list(t.lora_rank)}
    return dims


def trial_config(base: Config, params: Mapping) -> Config:
    """``base`` with a trial's nested ``params`` applied (a LoRA rank also turns LoRA on); validated."""
    tree = base.model_dump(mode="json")
    for section, values in params.items():
        if section not in tree or not isinstance(tree[section], dict):
            raise ConfigError(f"tune: this version has no config section {section!r} to search over")
        tree[section].update(values)
    if "rank" in params.get("lora", {}):
        tree["lora"]["enabled"] = True
    try:
        return Config.model_validate(tree)
    except ValueError as e:
        raise ConfigError(f"tune: a trial's config is invalid ({flatten(dict(params))}): {e}") from None


def grid_points(cfg: Config) -> list[dict]:
    """Every combination of the grid dimensions, with a log-uniform range at its low and high end
    (enough to check that every trial's config validates before Ray starts)."""
    dims = flatten(search_dimensions(cfg))
    axes = [v if isinstance(v, list) else list(v[1:]) for v in dims.values()]
    points = []
    for combo in itertools.product(*axes):
        nested: dict[str, dict] = {}
        for key, value in zip(dims, combo):
            section, name = key.split(".", 1)
            nested.setdefault(section, {})[name] = value
        points.append(nested)
    return points


def num_trials(cfg: Config) -> int:
    """Trials in the search: the grid's size times ``tune.num_samples``."""
    dims = flatten(search_dimensions(cfg))
    return math.prod(len(v) for v in dims.values() if isinstance(v, list)) * _tune_section(cfg).num_samples


def trial_resources(cfg: Config) -> dict[str, float]:
    """Logical resources one trial holds: its workers plus its driver (the Tune trial)."""
    s = cfg.scaling
    need = {"CPU": s.num_workers * s.cpus_per_worker + _tune_section(cfg).driver_cpus}
    if s.use_gpu:
        need["GPU"] = float(s.num_workers)
    return need


def max_concurrent_trials(cluster: Mapping[str, float], cfg: Config) -> int:
    """Trials that fit the cluster at once (each needs :func:`trial_resources`), capped by the
    number of trials and ``tune.max_concurrent_trials``: a trial that cannot get all its workers would
    only wait, holding its driver's resources."""
    need = trial_resources(cfg)
    fits = min(math.floor(cluster.get(name, 0.0) / amount + 1e-9) for name, amount in need.items())
    if fits < 1:
        have = {name: cluster.get(name, 0.0) for name in need}
        raise ConfigError(
            f"one trial needs {need} (scaling.num_workers={cfg.scaling.num_workers}, "
            f"scaling.cpus_per_worker={cfg.scaling.cpus_per_worker}, tune.driver_cpus="
            f"{_tune_section(cfg).driver_cpus}) but the cluster has {have}"
        )
    cap = _tune_section(cfg).max_concurrent_trials or fits
    return max(1, min(fits, cap, num_trials(cfg)))


def planned_steps(cfg: Config, train_rows: int) -> int:
    """Optimizer steps a trial runs when nothing stops it (as ``worker.Worker`` counts them)."""
    from raytrain_hymt.data.epochs import steps_per_epoch

    o = cfg.optim
    workers = cfg.scaling.num_workers
    return o.max_steps or o.epochs * steps_per_epoch(train_rows, workers, o.accumulation(workers), o.micro_batch_size)


@dataclass
class TrialRow:
    """One line of the search's result table."""

    trial_id: str
    params: dict[str, Any]
    """Searched values, flat (``optim.lr``)."""
    val_loss: float | None
    """The last validation loss the trial reported."""
    steps: int
    stopped_early: bool
    status: str
    """``done``, ``stopped`` (by ASHA), ``error: ...`` or ``unfinished`` (an interrupted search)."""
    run_dir: str
    checkpoint: str | None
    mlflow_run_id: str | None = None


def best_trial(rows: list[TrialRow]) -> TrialRow | None:
    """The trial with the lowest final validation loss among those that ran to the end (a trial ASHA
    stopped was compared at an earlier step; it is considered only when no trial finished)."""
    scored = [r for r in rows if r.val_loss is not None and math.isfinite(r.val_loss)]
    done = [r for r in scored if r.status == "done"]
    pool = done or scored
    return min(pool, key=lambda r: r.val_loss) if pool else None


def table_lines(rows: list[TrialRow]) -> list[str]:
    """The result table, one trial per line, sorted by validation loss (best first)."""
    keys = sorted({k for r in rows for k in r.params})
    header = ["trial", *keys, "val_loss", "steps", "stopped_early", "status"]
    body = []
    for r in sorted(rows, key=lambda r: (r.val_loss is None, r.val_loss if r.val_loss is not None else 0)):
        val = f"{r.val_loss:.4f}" if r.val_loss is not None else "-"
        body.append([r.trial_id, *(fmt_value(r.params.get(k)) for k in keys), val, str(r.steps),
                     "yes" if r.stopped_early else "no", r.status])
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [header, *body]]


def best_preset_yaml(base: Config, best: TrialRow, search: str) -> str:
    """A preset for ``hymt train --config``: ``base`` with the best trial's values, no search section."""
    nested: dict[str, dict] = {}
    for key, value in best.params.items():
        section, name = key.split(".", 1)
        nested.setdefault(section, {})[name] = value
    tree = trial_config(base, nested).model_dump(mode="json")
    for key in ("tune", "preset"):
        tree.pop(key, None)
    tree["run"]["name"] = None
    head = (f"# Best trial ({best.trial_id}) of the search '{search}': "
            f"{', '.join(f'{k}={fmt_value(v)}' for k, v in best.params.items())}; "
            f"validation loss {best.val_loss:.4f} after {best.steps} steps.\n"
            "# Train with it: hymt train --config <this file>  (or python jobs/train.py --config <this file>)\n")
    return head + yaml.safe_dump(tree, sort_keys=False, allow_unicode=True)


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def _tune_section(cfg: Config):
    if cfg.tune is None:
        raise ConfigError(
            "no 'tune' section in the config: set tune.lr_grid (a list) or tune.lr_range ([low, high]), "
            "e.g. --config tune-tiny-cpu or --set 'tune.lr_grid=[1e-4, 3e-4, 1e-3]'"
        )
    return cfg.tune
