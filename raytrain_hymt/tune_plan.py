"""The plan of a hyperparameter search (``hymt tune``) and its result table: the search space, each
trial's config and resources, how many trials run at once, the steps a trial runs, the best trial and the
preset that holds its values. No Ray here: :mod:`raytrain_hymt.tune` runs the search.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from raytrain_hymt.config import Config, flatten
from raytrain_hymt.errors import ConfigError

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
    from raytrain_hymt.ranks import steps_per_epoch

    o = cfg.optim
    return o.max_steps or o.epochs * steps_per_epoch(train_rows, cfg.scaling.num_workers, o.grad_accum,
                                                      o.micro_batch_size)


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
