"""The real-model path (issue #12): a model loaded from a folder through ``from_pretrained`` trains in
train mode with activation checkpointing really on, before and after a resume; LoRA checkpoints hold
only the adapters and resume exactly; the workers export (the driver never loads the weights, its memory
does not grow with the model); ``hymt export`` streams a stored checkpoint shard by shard in a Ray task.

A model folder saved by ``save_model_folder`` stands in for Hunyuan-MT-7B's (no machine here reaches the
hub; a hub id goes through the same ``from_pretrained``). ``file://`` storage with a sqlite MLflow store
stands in for a bucket with a tracking server: it takes the same URI code paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from conftest import REPO, save_model_folder, tiny_overrides
from fault_tolerance_common import attempts, effective, read_records
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.driver.train import run_training

pytestmark = pytest.mark.integration

LAYERS, ACCUM, STEPS = 4, 2, 6
#: Rank 0 is killed before this step once: two checkpoints (steps 2 and 4) lie before it, so the restart
#: resumes even when Ray had not yet registered the newest one when the worker died.
KILL_STEP = 5
sys.path.insert(0, str(REPO / "jobs"))  # bench_real_model's RSS probe


def _lora_run(storage: str, name: str, folder: str, **extra) -> list[str]:
    values = {
        "run.storage_root": storage, "run.name": name, "model.name_or_path": folder,
        "lora.enabled": True, "lora.rank": 4, "lora.alpha": 8, "lora.dropout": 0.1,
        "deepspeed.activation_checkpointing": True, "deepspeed.precision": "fp32",
        "optim.lr": 5e-3, "optim.micro_batch_size": 1, "optim.grad_accum": ACCUM, "optim.max_steps": STEPS,
        "checkpoint.every_steps": 2, "eval.every_steps": 1000, "tracking.enabled": False,
        "data.pack_tokens": 512, "data.max_example_tokens": 256,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="module")
def lora_runs(ray_session, tmp_path_factory, monkeypatch_module):
    """Two LoRA runs of a folder-loaded model with dropout and activation checkpointing: one straight
    through (on ``file://`` storage), one whose rank 0 is killed before ``KILL_STEP`` and resumes."""
    root = tmp_path_factory.mktemp("lora")
    folder = save_model_folder(root / "base")
    records = {"straight": root / "rec-straight", "resumed": root / "rec-resumed"}
    monkeypatch_module.setenv("HYMT_RECORD_DIR", str(records["straight"]))
    straight = run_training(load_config(None, _lora_run(
        f"file://{root}/uri-runs", "straight", folder, **{
            "tracking.enabled": True, "tracking.tracking_uri": f"sqlite:///{root}/mlflow.db",
            "tracking.tensorboard": True})))
    monkeypatch_module.setenv("HYMT_RECORD_DIR", str(records["resumed"]))
    monkeypatch_module.setenv("HYMT_FAULTS", json.dumps(
        [{"kind": "sigkill", "rank": 0, "step": KILL_STEP, "once": str(root / "killed-once")}]))
    resumed = run_training(load_config(None, _lora_run(str(root / "runs"), "resumed", folder)))
    monkeypatch_module.delenv("HYMT_FAULTS")
    return root, folder, records, straight, resumed


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_a_folder_model_trains_in_train_mode_with_checkpointing_before_and_after_a_resume(lora_runs):
    _, _, records, _, _ = lora_runs
    for run, folder in records.items():
        for rank in (0, 1):
            lines = read_records(folder, rank)
            # Two decoder-layer forwards per layer and micro-step: activation checkpointing recomputes in
            # backward (in eval mode transformers skips it and there is one), every module in train mode.
            assert {(r["layer_forwards"], r["training"]) for r in lines} == {(2 * LAYERS * ACCUM, True)}, run
    tries = [[r["step"] for r in a] for a in attempts(read_records(records["resumed"], 0))]
    assert len(tries) == 2 and tries[0] == list(range(1, KILL_STEP)), tries
    # The second attempt resumed after a checkpoint (steps 2 or 4), not from the start.
    assert tries[1][0] in (3, 5) and tries[1][-1] == STEPS, tries


def test_lora_resume_is_exact_with_dropout_on(lora_runs):
    _, _, records, straight, resumed = lora_runs
    want, got = effective(read_records(records["straight"], 0)), effective(read_records(records["resumed"], 0))
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step]["example_ids"] == want[step]["example_ids"]
        assert abs(got[step]["loss"] - want[step]["loss"]) < 1e-5, step
    assert resumed.train_loss == pytest.approx(straight.train_loss, abs=1e-5)


def test_lora_checkpoint_holds_only_what_trains(lora_runs):
    from raytrain_hymt.train.checkpoint import read_state
    from raytrain_hymt.train.engine import apply_lora
    from raytrain_hymt.train.export import _checkpoint_tensors
    from raytrain_hymt.train.model import load_model
    from raytrain_hymt.tokenizer import load_tokenizer

    root, folder, _, _, resumed = lora_runs
    ckpt = Path(resumed.checkpoint)
    state = read_state(ckpt)
    assert state.base_model["name_or_path"] == str(Path(folder).resolve()) and state.base_model["weights_sha256"]
    cfg = load_config(None, _lora_run(str(root), "x", folder))
    peft = apply_lora(load_model(folder, load_tokenizer(folder)), cfg.lora)
    trainable = {n for n, p in peft.named_parameters() if p.requires_grad}
    assert set(dict(_checkpoint_tensors(ckpt, state.tag, 2))) == trainable  # no frozen tensor
    deepspeed_bytes = sum(p.stat().st_size for p in (ckpt / state.tag).rglob("*") if p.is_file())
    base_bytes = sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
    assert deepspeed_bytes < 0.25 * base_bytes, (deepspeed_bytes, base_bytes)  # ~3% of the base plus pickles


def test_resume_or_export_on_another_base_stops(lora_runs, tmp_path):
    from raytrain_hymt.train.checkpoint import BaseModelMismatchError, check_base_model, read_state

    _, folder, _, _, resumed = lora_runs
    saved = read_state(Path(resumed.checkpoint)).base_model
    check_base_model(saved, "resuming")  # the same folder, unchanged
    other = save_model_folder(tmp_path / "other", hidden_size=64, intermediate_size=128)
    with pytest.raises(BaseModelMismatchError) as e:
        check_base_model(saved, "resuming from ckpt", other, 0)
    assert "LoRA adapters were trained on base" in str(e.value) and "weights_sha256" in str(e.value)
    assert "point model.name_or_path at the original base" in str(e.value)


def test_worker_export_on_uri_storage_with_the_logs_published(lora_runs):
    """The straight run stored at a ``file://`` URI: the workers wrote the merged model and the adapter
    folder there, and rank 0's metrics.jsonl and TensorBoard files were copied into the run folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, folder, _, straight, _ = lora_runs
    run = root / "uri-runs" / "straight"
    assert straight.model_dir == f"file://{root}/uri-runs/straight/model"
    merged = AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32).eval()
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                       run / "adapter").eval()
    ids = torch.tensor([[5, 17, 300, 41, 9, 77]])
    assert (merged(ids).logits - served(ids).logits).abs().max().item() < 1e-5
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert set(range(1, STEPS + 1)) <= set(steps)
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))


def _driver_peak_rss_mib(args: list[str], env: dict) -> int:
    """Peak RSS of the driver process alone: it joins the running cluster and starts no Ray of its own."""
    from bench_real_model import peak_rss_until_exit

    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "raytrain_hymt.cli", "train", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        peak = peak_rss_until_exit(proc)
        log.seek(0)
        assert proc.returncode == 0, log.read()[-4000:]
    return peak // 2**20


def test_driver_memory_does_not_grow_with_the_model(ray_session, tmp_path):
    """The driver only learns where the workers wrote the model: its peak RSS is the same for the tiny
    model and one 12× larger (exporting on the driver used to hold the full fp32 weights several times)."""
    from transformers import AutoConfig

    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address, HYMT_VERBOSE="")
    peaks = {}
    for name, shape in {"small": {}, "large": {"hidden_size": 512, "intermediate_size": 1536,
                                                "num_attention_heads": 8, "num_key_value_heads": 4,
                                                "head_dim": 64, "num_hidden_layers": 6}}.items():
        folder = save_model_folder(tmp_path / name, **shape)
        args = ["--set", f"model.name_or_path={folder}", "--name", name,
                *[a for o in tiny_overrides(tmp_path / "runs", **{"optim.max_steps": 2, "checkpoint.every_steps": 2,
                                                                    "tracking.enabled": False, "data.pack_tokens": 256})
                  for a in ("--set", o)]]
        peaks[name] = _driver_peak_rss_mib(args, env)
        exported = AutoConfig.from_pretrained(tmp_path / "runs" / name / "model")
        assert exported.hidden_size == shape.get("hidden_size", 128)
    params = {n: sum(t.numel() for t in _tensors(tmp_path / "runs" / n / "model")) for n in peaks}
    assert params["large"] > 10 * params["small"], params
    assert abs(peaks["large"] - peaks["small"]) < 100, peaks


def _tensors(folder: Path):
    from safetensors import safe_open

    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            yield from (f.get_tensor(k) for k in f.keys())  # noqa: SIM118


def test_hymt_export_streams_a_stored_checkpoint_in_a_ray_task(finished_run, ray_session, tmp_path, capsys,
                                                              monkeypatch):
    """``hymt export`` on a cluster (RAY_ADDRESS: the session's Ray) of the e2e run's last checkpoint with 1 MB
    shards gives the very weights the workers exported, in several shards with an index, from a task whose
    peak memory is reported and bounded."""
    import re

    from raytrain_hymt.cli import main

    _, summary = finished_run
    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    assert main(["export", summary.checkpoint, str(tmp_path / "model"), "--max-shard-mb", "1"]) == 0
    said = capsys.readouterr().out
    peak = float(re.search(r"peak memory of the export task ([\d.]+) GiB", said).group(1))
    assert 0 < peak < 2 * 0.001 + 2
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 5
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(tmp_path / "model" / shard), framework="pt") as f:
            keys = list(f.keys())  # noqa: SIM118
        # A shard passes 1 MB only when it is one tensor larger than that (the embedding: 2 MB).
        assert len(keys) == 1 or (tmp_path / "model" / shard).stat().st_size <= 10**6 + 10**4, shard
    from transformers import AutoModelForCausalLM

    mine = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(summary.model_dir, dtype=torch.float32).state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_checkpoint_generation_comes_from_storage(tmp_path):
    import pyarrow.fs

    from raytrain_hymt.train.checkpoint import next_generation

    fs = pyarrow.fs.LocalFileSystem()
    assert next_generation(fs, str(tmp_path)) == 1
    for name in ("checkpoint_step00000004", "checkpoint_step00000006-g3", "checkpoint_step00000008-g1", "model"):
        (tmp_path / name).mkdir()
    assert next_generation(fs, str(tmp_path)) == 4  # not saved + 1, which could name a folder still there


def test_num_to_keep_below_two_is_refused_with_the_reason():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["checkpoint.num_to_keep=1"])
    assert "checkpoint.num_to_keep must be at least 2 (got 1)" in str(e.value)
    assert "resumes from the one before" in str(e.value)


def test_export_swap_never_leaves_a_moment_without_a_model_folder(tmp_path):
    from raytrain_hymt.train.export import _swap_in

    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("0")
    missing, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            if not (out / "config.json").exists():
                missing.append(1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for i in range(1, 200):
        new = tmp_path / f"new{i}"
        new.mkdir()
        (new / "config.json").write_text(str(i))
        _swap_in(new, out)
    stop.set()
    watcher.join()
    assert not missing
    assert (out / "config.json").read_text() == "199"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the old exports are gone
