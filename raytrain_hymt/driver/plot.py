"""``hymt plot RUN [--compare RUN2 ...]``: one PNG of a run's curves against the optimizer step.

Panels: train and validation loss, BLEU/chrF when logged (during training: ``val/<set>/<dir>/bleu``; at
the end: ``test/<set>/<dir>/bleu``), learning rate, and tokens/s per worker. The values come from the
run's ``metrics.jsonl`` (every metric rank 0 and the driver logged, whatever MLflow did), or from its
MLflow run when that file is not on this machine (a URI storage root). Drawn with matplotlib's Agg
canvas directly: no display and no pyplot state are needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from raytrain_hymt.errors import ConfigError
from raytrain_hymt.tracking.metrics_log import read_metrics

#: (panel title, y label, the metric keys it draws: exact names, or a ``*/suffix`` pattern).
PANELS = (
    ("loss", "token loss", ("train/loss", "val/loss")),
    ("BLEU / chrF", "score", ("*/bleu", "*/chrf")),
    ("learning rate", "lr", ("train/lr",)),
    ("throughput", "tokens/s per worker", ("train/tokens_per_s_per_worker",)),
)

Series = dict[str, list[tuple[int, float]]]
"""Metric key → ``(step, value)`` points, sorted by step (the last value logged wins for a step)."""


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(key == p or (p.startswith("*/") and key.endswith(p[1:])) for p in patterns)


def _points(triples) -> Series:
    by_key: dict[str, dict[int, float]] = {}
    for key, step, value in triples:
        by_key.setdefault(key, {})[int(step)] = float(value)  # a resumed run logs a step again: keep the last
    return {k: sorted(v.items()) for k, v in by_key.items()}


def read_metrics_jsonl(path: Path) -> Series:
    """Every metric of a ``metrics.jsonl``; a cut-off last line (a crash mid-write) is ignored."""
    return _points((key, step, value) for key, value, step, _ in read_metrics(path))


def read_run(storage_root: str, name: str) -> Series:
    """The metrics of run ``name`` under ``storage_root``: its metrics.jsonl, else its MLflow run."""
    from raytrain_hymt.storage import METRICS_FILE, RUN_FILE, RunFolder

    folder = RunFolder(storage_root, name, create=False)
    local = folder.local / METRICS_FILE
    if local.is_file():
        return read_metrics_jsonl(local)
    saved = json.loads(folder.read_text(RUN_FILE) or "{}")
    if not saved.get("mlflow_run_id"):
        raise ConfigError(f"run {name}: no metrics.jsonl in {folder.local} and no MLflow run in {folder.uri}/{RUN_FILE} "
                          f"(is run.storage_root {storage_root} the one it trained with?)")
    import mlflow

    client = mlflow.MlflowClient(saved.get("tracking_uri"))
    run = client.get_run(saved["mlflow_run_id"])
    return _points((k, m.step, m.value) for k in run.data.metrics for m in client.get_metric_history(run.info.run_id, k))


def figure(runs: dict[str, Series]):
    """A matplotlib Figure of ``runs`` (name → series), one line per run and metric, labelled
    ``<run> <metric>``; panels without any logged metric say so instead of staying blank."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 7), dpi=80, layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).flatten()
    colors = [f"C{i}" for i in range(10)]
    styles = ["-", "--", ":", "-."]
    for ax, (title, ylabel, patterns) in zip(axes, PANELS):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        drawn = 0
        for r, (name, series) in enumerate(runs.items()):
            keys = sorted(k for k in series if _matches(k, patterns))
            for s, key in enumerate(keys):
                steps, values = zip(*series[key])
                ax.plot(steps, values, styles[s % len(styles)], color=colors[r % len(colors)],
                        marker="o" if len(steps) == 1 else None, label=f"{name} {key}")
                drawn += 1
        if drawn:
            ax.legend(fontsize="x-small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in axes[2:]:
        ax.set_xlabel("step")
    return fig


def plot_runs(storage_root: str, names: list[str], out: str | Path):
    """Write the PNG of runs ``names`` (the first one, then those compared with it) to ``out``; returns
    the Figure (its lines hold exactly the plotted values)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure({name: read_run(storage_root, name) for name in names})
    FigureCanvasAgg(fig)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return fig
