"""A finished run submitted again, through ``hymt train`` on conftest's ``finished_run`` (``e2e``, 20 steps):
a changed learning rate is refused before Ray starts, too few steps are one line, and ``model.init_from``
starts a new run on its weights, which a larger ``optim.max_steps`` then continues.

In the training test a NaN loss (``HYMT_FAULTS``, ``checkpoint.on_nonfinite: skip``) stands in for an update
of zero: the step runs and is counted, its update is discarded, so the model a run exports after it holds
exactly the weights that step started from. That is how the test sees, tensor by tensor, which weights a
run started with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import tiny_overrides
from fault_tolerance_common import read_records
from raytrain_hymt.cli import main
from test_mistakes import hymt

pytestmark = pytest.mark.integration


def _sets(storage: Path, **extra: object) -> list[str]:
    return [arg for o in tiny_overrides(storage, **extra) for arg in ("--set", o)]


def test_a_changed_lr_on_a_finished_run_stops_before_ray_naming_it(finished_run, tmp_path):
    storage, summary = finished_run
    run = hymt(tmp_path, "train", "--name", "e2e", *_sets(storage), "--set", "optim.max_steps=80",
               "--set", "optim.lr=1e-3")
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr == (
        "error: run 'e2e' started with another config; resuming it with this one would change what it trains "
        "(1 field):\n  optim.lr: 0.002 -> 0.001\nResume anyway with --set run.allow_config_change=true (the change "
        "is recorded in config-changes.jsonl), or start a new run from its weights with another --name and --set "
        "model.init_from=e2e.\n")
    assert not list((tmp_path / "home").glob("**/session_*"))  # no Ray started
    assert json.loads((Path(summary.run_dir) / "summary.json").read_text())["steps"] == 20


def test_a_finished_run_asked_for_no_more_steps_is_one_line(finished_run, capsys):
    storage, _ = finished_run
    assert main(["train", "--name", "e2e", *_sets(storage, **{"optim.max_steps": 10})]) == 2
    assert capsys.readouterr().err == ("error: run 'e2e' finished at step 20: optim.max_steps=10 trains nothing more; "
                                       "continue it with an optim.max_steps larger than 20\n")


def _weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_same_weights(model_dir: str | Path, reference: dict[str, torch.Tensor]) -> None:
    weights = _weights(model_dir)
    assert weights.keys() == reference.keys()
    assert [k for k in reference if not torch.equal(weights[k], reference[k])] == []


def test_init_from_starts_a_new_run_on_the_checkpoints_weights_and_more_steps_continue_it(
        finished_run, tmp_path, monkeypatch):
    import mlflow

    storage, summary = finished_run
    source = Path(summary.checkpoint)  # checkpoint_step00000020: the weights e2e exported at its end
    reference = _weights(summary.model_dir)
    record = tmp_path / "record"
    monkeypatch.setenv("HYMT_RECORD_DIR", str(record))
    monkeypatch.setenv("HYMT_FAULTS", json.dumps([{"kind": "nan", "rank": 0, "step": s} for s in (1, 2)]))
    runs = tmp_path / "runs"
    warm = ["train", "--name", "warm", "--set", f"model.init_from={summary.run_dir}",
            "--set", "checkpoint.every_steps=1", "--set", "eval.every_steps=1000"]

    # A new run from e2e's folder (its newest whole checkpoint): step 1 of 1, on e2e's step-20 weights.
    assert main([*warm, *_sets(runs, **{"optim.max_steps": 1})]) == 0
    run_dir = runs / "warm"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["init_from"] == str(source)
    first = json.loads((run_dir / "summary.json").read_text())
    client = mlflow.MlflowClient(first["tracking_uri"])
    assert client.get_run(first["mlflow_run_id"]).data.params["model.init_from"] == str(source)
    assert [(r["step"], r["skipped"]) for r in read_records(record, 0)] == [(1, True)]
    _assert_same_weights(first["model_dir"], reference)

    # Two steps: it continues from its checkpoint at step 1 and trains step 2 only, in the same MLflow run.
    assert main([*warm, *_sets(runs, **{"optim.max_steps": 2})]) == 0
    second = json.loads((run_dir / "summary.json").read_text())
    assert second["steps"] == 2 and second["mlflow_run_id"] == first["mlflow_run_id"]
    assert [(r["step"], r["skipped"]) for r in read_records(record, 0)] == [(1, True), (2, True)]
    skipped = client.get_metric_history(first["mlflow_run_id"], "train/skipped_steps")
    assert [(m.step, m.value) for m in skipped] == [(1, 1.0), (2, 2.0)]  # its run state came from the checkpoint
    _assert_same_weights(second["model_dir"], reference)
    changes = [json.loads(line) for line in (run_dir / "config-changes.jsonl").read_text().splitlines()]
    assert [(c["field"], c["before"], c["after"]) for line in changes for c in line["changes"]] == [
        ("optim.max_steps", 1, 2)]
