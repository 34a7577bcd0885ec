"""``hymt plot``: the PNG exists, and the Figure's lines hold exactly the values the run logged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from raytrain_hymt.cli import main


def _logged(path: Path) -> dict[str, list[tuple[int, float]]]:
    """The test's own reading of metrics.jsonl: key → [(step, value)] (the last value of a step)."""
    out: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "metric":
            out.setdefault(rec["key"], {})[rec["step"]] = rec["value"]
    return {k: sorted(v.items()) for k, v in out.items()}


def _lines(fig) -> dict[str, list[tuple[int, float]]]:
    return {line.get_label(): list(zip(map(int, line.get_xdata()), map(float, line.get_ydata())))
            for ax in fig.axes for line in ax.get_lines()}


@pytest.mark.integration
def test_plot_draws_the_logged_values_and_compares_runs(finished_run, tmp_path, capsys):
    from raytrain_hymt.driver.plot import plot_runs

    storage, summary = finished_run
    logged = _logged(Path(summary.run_dir) / "metrics.jsonl")
    # A second run to compare with, given as a metrics.jsonl of its own (what a real run's rank 0 writes).
    other = storage / "other"
    other.mkdir(exist_ok=True)
    (other / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "metric", "step": s, "key": "train/loss", "value": 9.0 - s / 10, "time": 0}) + "\n"
        for s in range(1, 6)))
    out = tmp_path / "plot.png"
    assert main(["plot", "e2e", "--compare", "other", "--set", f"run.storage_root={storage}", "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"plot: {out}\n"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000

    fig = plot_runs(str(storage), ["e2e", "other"], tmp_path / "again.png")
    lines = _lines(fig)
    for key in ("train/loss", "val/loss", "train/lr", "train/tokens_per_s_per_worker",
                "test/devtest/en-zh/bleu", "test/devtest/zh-en/chrf"):
        assert lines[f"e2e {key}"] == logged[key]
    assert [s for s, _ in lines["e2e val/loss"]] == [10, 20] and len(lines["e2e train/loss"]) == 20
    assert lines["other train/loss"] == [(s, 9.0 - s / 10) for s in range(1, 6)]
    assert "other val/loss" not in lines  # nothing invented for a metric the run never logged
    assert [ax.get_title() for ax in fig.axes] == ["loss", "BLEU / chrF", "learning rate", "throughput"]

    # Without a metrics.jsonl on this machine (a URI storage root) the same values come from MLflow.
    mirror = storage / "mirror"
    mirror.mkdir(exist_ok=True)
    shutil.copy(Path(summary.run_dir) / "run.json", mirror / "run.json")
    from_mlflow = _lines(plot_runs(str(storage), ["mirror"], tmp_path / "mlflow.png"))
    for key in ("train/loss", "val/loss"):
        steps, values = zip(*from_mlflow[f"mirror {key}"])
        assert list(steps) == [s for s, _ in logged[key]]
        assert list(values) == pytest.approx([v for _, v in logged[key]])  # MLflow stores doubles too


def test_a_run_without_metrics_is_named_in_the_error(tmp_path, capsys):
    assert main(["plot", "ghost", "--set", f"run.storage_root={tmp_path}"]) == 2
    assert f"error: run ghost: no metrics.jsonl in {tmp_path / 'ghost'}" in capsys.readouterr().err
