"""The main job end to end on the embedded default: Ray Data → TorchTrainer(2 CPU workers, ZeRO-2) →
checkpoint with every rank's shard → MLflow (sqlite at the storage root) → exported HF model.
The run itself is conftest's ``finished_run`` (tests/integration/test_evaluate.py checks its BLEU/chrF)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raytrain_hymt.cli import main

pytestmark = pytest.mark.integration


def test_checkpoint_holds_every_rank_shard(finished_run):
    storage, summary = finished_run
    ckpt = Path(summary.checkpoint)
    assert ckpt.name == "checkpoint_step00000020"
    assert json.loads((ckpt / "state.json").read_text())["step"] == 20
    assert sorted(p.name for p in (ckpt / "complete").iterdir()) == ["rank0", "rank1"]
    shards = sorted(p.name for p in (ckpt / "step00000020").glob("*optim_states.pt"))
    assert len(shards) == 2 and "zero_pp_rank_0" in shards[0] and "zero_pp_rank_1" in shards[1]
    # num_to_keep=2: the step-10 and step-20 checkpoints.
    assert sorted(p.name for p in Path(summary.run_dir).glob("checkpoint_step*")) == [
        "checkpoint_step00000010", "checkpoint_step00000020"]


def test_checkpoints_pickle_no_project_class(finished_run):
    """A checkpoint outlives the code that wrote it (a run resumes after an upgrade that moved modules):
    its pickled files (torch's zip of ``data.pkl``, stored uncompressed) name no class of this package,
    so unpickling never imports a module path of it. Its own state travels as JSON (``state.json``)."""
    storage, summary = finished_run
    pickled = [p for p in Path(summary.run_dir).glob("checkpoint_step*/**/*")
               if p.is_file() and p.suffix in (".pt", ".bin", ".pkl")]
    assert len(pickled) >= 4  # each checkpoint: every rank's optimizer shard and the model states
    assert [p.name for p in pickled if b"raytrain_hymt" in p.read_bytes()] == []
    planted = Path(summary.run_dir) / "planted.pt"
    from raytrain_hymt.train.checkpoint import RunState  # a project class, as a careless save would pickle it

    torch.save({"state": RunState(step=1, epoch=0, batch_in_epoch=1, world_size=1, tag="x", zero_stage=2)}, planted)
    try:
        assert b"raytrain_hymt" in planted.read_bytes()  # the check above would see one
    finally:
        planted.unlink()


def test_loss_falls_and_mlflow_has_the_run(finished_run):
    import mlflow

    storage, summary = finished_run
    assert summary.tracking_uri == f"sqlite:///{storage}/mlflow.db"
    client = mlflow.MlflowClient(summary.tracking_uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.max_steps"] == "20"
    assert run.data.params["deepspeed.zero_stage"] == "2"
    assert run.data.metrics["data.rows_read"] == 10390
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 21))
    first, last = history[0].value, history[-1].value
    assert first > 8.0  # ln(4032) ≈ 8.3: a random model
    assert last < first - 1.0, (first, last)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/loss")] == [10, 20]
    assert summary.train_loss == pytest.approx(last, rel=1e-6)


def test_exported_model_loads_with_transformers(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _, summary = finished_run
    model = AutoModelForCausalLM.from_pretrained(summary.model_dir)
    tok = AutoTokenizer.from_pretrained(summary.model_dir)
    gen = GenerationConfig.from_pretrained(summary.model_dir)
    assert model.config.model_type == "hunyuan_v1_dense"
    assert (gen.top_k, gen.top_p, gen.repetition_penalty, gen.temperature) == (20, 0.6, 1.05, 0.7)
    assert tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Translate: hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_rerunning_a_finished_run_prints_its_summary(finished_run, capsys):
    from conftest import tiny_overrides

    storage, summary = finished_run
    # Its own settings: another trajectory would be refused (tests/integration/test_finished_runs.py).
    status = main(["train", "--name", "e2e", *[arg for o in tiny_overrides(storage) for arg in ("--set", o)]])
    out = capsys.readouterr().out
    assert status == 0
    assert "run e2e already finished" in out
    assert summary.model_dir in out
