"""BLEU/chrF during training (eval.bleu_every_steps) on conftest's ``finished_run`` (CPU, fp32, ZeRO-2):
logged at the right steps, and equal to ``hymt evaluate`` on the model exported at the same step, which
re-runs the same translation in another process from the saved weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_hymt.cli import main
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.evaluation.scoring import read_history

from conftest import FLORES_DEVTEST


def test_bleu_during_training_needs_a_test_set():
    with pytest.raises(ConfigError, match="eval.bleu_every_steps translates a sample of eval.test_set: set eval.test_set"):
        load_config(None, ["eval.bleu_every_steps=10"])
    assert load_config(None, []).eval.bleu_every_steps is None  # off by default


def _logged(run_dir: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["kind"] == "metric" and rec["key"].startswith("val/devtest/"):
            out.setdefault(rec["key"], {})[rec["step"]] = rec["value"]
    return out


@pytest.mark.integration
def test_scores_are_logged_every_n_steps_and_equal_hymt_evaluate_at_that_step(finished_run, tmp_path):
    import mlflow

    from conftest import E2E_EVAL

    storage, summary = finished_run
    run_dir = Path(summary.run_dir)
    logged = _logged(run_dir)
    keys = {f"val/devtest/{d}/{m}" for d in ("en-zh", "zh-en") for m in ("bleu", "chrf", "chrfpp", "ter")}
    assert set(logged) == keys and all(sorted(v) == [10, 20] for v in logged.values())
    client = mlflow.MlflowClient(summary.tracking_uri)
    assert [m.step for m in client.get_metric_history(summary.mlflow_run_id, "val/devtest/zh-en/chrf")] == [10, 20]
    assert [m.step for m in client.get_metric_history(summary.mlflow_run_id, "val/bleu_seconds")] == [10, 20]

    # Step 20 is the model the run exported: the end-of-run evaluation of the same rows scores the same.
    final = summary.test_scores["scores"]
    for d in ("en-zh", "zh-en"):
        for m in ("bleu", "chrf", "chrfpp", "ter"):
            assert logged[f"val/devtest/{d}/{m}"][20] == final[d][m]

    # Step 10: export its checkpoint and score it with hymt evaluate, in a fresh run of its own.
    history = read_history(run_dir / "eval" / "devtest-training")
    assert [h["step"] for h in history] == [10, 20] and history[0]["model"] == "training step 10"
    export = tmp_path / "step10"
    assert main(["export", str(run_dir / "checkpoint_step00000010"), str(export)]) == 0
    common = ["--test-set", str(FLORES_DEVTEST), "--set", f"run.storage_root={storage}"]
    common += [a for k, v in E2E_EVAL.items() for a in ("--set", f"{k}={v}")]
    assert main(["evaluate", "--model", str(export), "--name", "step10", *common]) == 0
    again = json.loads((storage / "step10" / "eval" / "devtest" / read_history(storage / "step10" / "eval" / "devtest")[-1]["dir"]
                        / "scores.json").read_text())["scores"]
    assert again == history[0]["scores"]
    for d in ("en-zh", "zh-en"):
        assert logged[f"val/devtest/{d}/bleu"][10] == again[d]["bleu"]
        sample_dir = run_dir / "eval" / "devtest-training" / history[0]["dir"]
        assert (sample_dir / f"{d}.hyp").read_text() == (
            storage / "step10" / "eval" / "devtest" / read_history(storage / "step10" / "eval" / "devtest")[-1]["dir"]
            / f"{d}.hyp").read_text()

    # The sample translations are MLflow artifacts, in the evaluation history's layout.
    stamp = f"eval/devtest-training/{history[1]['dir']}"
    assert {a.path for a in client.list_artifacts(summary.mlflow_run_id, stamp)} == {
        f"{stamp}/en-zh.hyp", f"{stamp}/zh-en.hyp", f"{stamp}/scores.json"}
