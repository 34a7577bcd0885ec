"""The GPU benchmark (jobs/benchmark.py, benchmarks.throughput) on CPU: its pure parts, and one real smoke run
of the tiny model through TorchTrainer and through torchrun on the same batches. GPU-only parts (flex
attention training, Liger's fused loss, torch.compile) are skipped here with the reason; their figures
come from the benchmark on 2×H200 (benchmarks/results/2026-11-30-gpu-throughput-2xh200.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.throughput import (
    CASES,
    document_mask_check,
    markdown_table,
    parse_case,
    repeat_sources,
    run_benchmark,
    summarize,
)
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_seven_b_shape_has_the_published_parameter_counts():
    from transformers import AutoConfig, AutoModelForCausalLM

    from raytrain_hymt.train.flops import matmul_params
    from raytrain_hymt.train.model import hunyuan_7b_config

    counts = {}
    for tied in (True, False):
        cfg = AutoConfig.for_model(**hunyuan_7b_config(tie_word_embeddings=tied))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        counts[tied] = (sum(p.numel() for p in model.parameters()), matmul_params(model))
    # FACTS.md: tied 7.50 B, untied 8.03 B; the input embedding of the untied model does no matmul.
    assert counts[True] == (7_504_568_320, 7_504_568_320)
    assert counts[False] == (8_029_540_352, 7_504_568_320)


def test_random_model_from_a_config_file(tmp_path):
    from raytrain_hymt.train.model import hunyuan_7b_config, load_model
    from raytrain_hymt.tokenizer import RANDOM_PREFIX, load_tokenizer

    shape = hunyuan_7b_config(layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=4096, pad_token_id=2, eos_token_id=1)
    (tmp_path / "c.json").write_text(json.dumps(shape))
    tok = load_tokenizer("tiny")
    model = load_model(f"{RANDOM_PREFIX}{tmp_path / 'c.json'}", tok)
    assert model.config.model_type == "hunyuan_v1_dense" and model.config.num_hidden_layers == 1
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    with pytest.raises(ValueError, match="no such config.json"):
        load_model(f"{RANDOM_PREFIX}{tmp_path / 'missing.json'}", tok)
    (tmp_path / "small.json").write_text(json.dumps({**shape, "vocab_size": 100}))
    with pytest.raises(ValueError, match="vocab_size 100 is smaller than the tokenizer"):
        load_model(f"{RANDOM_PREFIX}{tmp_path / 'small.json'}", tok)


def test_summarize_counts_only_steps_after_warmup():
    steps = [
        {"wall_s": 9.0, "step_s": 8.0, "tokens": 100.0, "flops": 1e12, "padded_tokens": 128.0},  # warm-up
        {"wall_s": 2.0, "step_s": 1.0, "tokens": 400.0, "flops": 4e12, "padded_tokens": 500.0},
        {"wall_s": 2.0, "step_s": 3.0, "tokens": 400.0, "flops": 4e12, "padded_tokens": 500.0},
    ]
    s = summarize(steps, warmup=1, world=2, peak_flops=1e12)
    assert s["steps_measured"] == 2
    assert s["tokens_per_s_per_gpu"] == pytest.approx(800 / 4 / 2)  # wall clock, data waits included
    assert s["step_time_s_median"] == pytest.approx(2.0)
    assert s["padding_fraction"] == pytest.approx(0.2)
    assert s["mfu"] == pytest.approx(8e12 / (4 * 2 * 1e12))
    assert summarize(steps, 1, 2, None)["mfu"] is None
    with pytest.raises(ValueError, match="no steps measured: 3 steps run, 3 of them warm-up"):
        summarize(steps, warmup=3, world=2, peak_flops=None)


def test_cases_parse_and_unknown_names_are_refused():
    case = parse_case("z2-flex-4k-a4@torchrun")
    assert case.torchrun and case.overrides == CASES["z2-flex-4k-a4"]
    custom = parse_case("mine:optim.grad_accum=2,deepspeed.zero_stage=3")
    assert not custom.torchrun and custom.overrides == ["optim.grad_accum=2", "deepspeed.zero_stage=3"]
    with pytest.raises(ValueError, match="unknown case 'nope'"):
        parse_case("nope")
    preset = parse_case("preset:hy-mt-7b-lora,model.compile=true")
    assert (preset.preset, preset.overrides) == ("hy-mt-7b-lora", ["model.compile=true"])
    table = markdown_table([{"case": "x", "launcher": "torchrun", "error": "RuntimeError: CUDA out of memory"}])
    assert "| x | torchrun |" in table and "failed: RuntimeError: CUDA out of memory" in table


def test_repeat_sources_reads_every_source_more_often():
    cfg = load_config(None, ["data.sources=[{path: 'sample:', weight: 0.5}, {path: 'sample:'}]"])
    repeat_sources(cfg, 3)
    assert [s.weight for s in cfg.data.sources] == [1.5, 3.0]


@pytest.mark.parametrize("lever", ["fused_loss", "compile"])
def test_gpu_only_levers_are_refused_on_cpu(lever):
    with pytest.raises(ConfigError, match=f"model.{lever} needs GPUs"):
        load_config(None, [f"model.{lever}=true"])


@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_document_mask_keeps_packed_pairs_apart(attn):
    # Forward only: CPU flex attention has a forward (its training needs the GPU).
    assert document_mask_check("cpu", attn) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention on the GPU: needs CUDA (measured on "
                    "2×H200 by jobs/benchmark.py --check-mask; 5.96e-07 on 2026-11-30)")
def test_document_mask_on_gpu():
    assert document_mask_check("cuda", "flex_attention") < 1e-4


def test_benchmark_smoke_ray_train_and_torchrun_agree(ray_session, tmp_path):
    """One short case under TorchTrainer and the same case under torchrun: same batches, same losses."""
    out = tmp_path / "bench"
    results = run_benchmark(
        ["cpu-packed", "cpu-packed@torchrun", "preset:tiny-cpu"], shape="tiny", steps=2, warmup=1, workers=2,
        use_gpu=False, out_dir=out, extra=["data.pack_tokens=512"],
    )
    assert [r.get("error") for r in results] == [None, None, None]
    ray_r, torchrun_r, preset_r = results
    # The model is a folder loaded through from_pretrained, as `hymt train` loads one; a preset case keeps
    # the preset's own settings (tiny-cpu: micro-batch 2, its warmup and cosine schedule).
    assert (out / "tiny" / "config.json").exists() and (out / "tiny" / "tokenizer.json").exists()
    assert (preset_r["preset"], preset_r["micro_batch"], preset_r["grad_accum"]) == ("tiny-cpu", 2, 1)
    results = results[:2]
    assert (ray_r["launcher"], torchrun_r["launcher"]) == ("ray-train", "torchrun")
    for r in results:
        assert r["steps_measured"] == 2 and r["world"] == 2 and r["zero_stage"] == 2
        assert r["layout"] == "packed 512 sdpa" and r["mfu"] is None and r["device"] == "cpu"
        assert len(r["losses"]) == 3 and r["tokens_per_s_per_gpu"] > 0
        assert 0 <= r["padding_fraction"] < 0.2
    # The torchrun ranks replay exactly the global batches Ray Data produced: identical work and losses.
    assert torchrun_r["tokens_per_step"] == ray_r["tokens_per_step"]
    assert torchrun_r["losses"] == pytest.approx(ray_r["losses"], rel=1e-5)
    lines = (out / "results.jsonl").read_text().splitlines()
    assert [json.loads(x)["case"] for x in lines] == ["cpu-packed", "cpu-packed@torchrun", "preset:tiny-cpu"]
    table = (out / "table.md").read_text()
    assert "| cpu-packed | ray-train | 2 | packed 512 sdpa | 1 × 2 |" in table
    assert "| cpu-packed@torchrun | torchrun |" in table


def test_benchmark_cli_rejects_unknown_case(capsys):
    sys.path.insert(0, str(REPO / "jobs"))
    try:
        import benchmark
    finally:
        sys.path.remove(str(REPO / "jobs"))
    with pytest.raises(ValueError, match="unknown case 'bogus'"):
        benchmark.main(["--cpu", "--shape", "tiny", "--case", "bogus"])


def test_a_benchmark_rank_ends_with_its_output_and_without_the_interpreters_shutdown(tmp_path):
    """end_rank, which the torchrun and spawned ranks call last: what the rank printed and logged reaches its
    parent, it exits 0, and no shutdown code runs (where gloo's threads can abort a finished rank)."""
    script = f"""
import atexit, logging, torch.distributed as dist
from benchmarks.rank_exit import end_rank
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
atexit.register(print, " and the interpreter's shutdown")
logging.basicConfig(format="%(message)s")
logging.getLogger("bench").warning("logged")
print("printed", end="")
end_rank()
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe buffers what is printed
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stdout, done.stderr) == (0, "printed", "logged\n")


def test_zero3_load_benchmark_measures_both_ways(tmp_path):
    """jobs/bench_zero3_load.py's measurement on the tiny model: two real gloo ranks per way of loading."""
    from benchmarks.zero3_load import measure

    rows = measure(None, 2, False, str(tmp_path))
    assert sorted((r["partitioned_load"], r["rank"]) for r in rows) == [(False, 0), (False, 1), (True, 0), (True, 1)]
    for r in rows:
        assert r["params"] == 1_820_032 and r["world"] == 2 and r["gpu_gib"] is None
        assert r["loaded_partitioned"] == r["partitioned_load"]  # zero.Init did partition (and only then)
        assert 0 < r["peak_private_gib_load"] <= r["peak_rss_gib_after_load"]
    assert not list(tmp_path.iterdir())  # the model folder is temporary


def test_checkpoint_benchmark_scales_along_the_parameter_count_to_the_full_model():
    """jobs/bench_checkpoint.py measures small models (fewer layers, a smaller vocabulary on a CPU machine)
    and evaluates a straight line in the parameter count at the full Hunyuan-MT-7B's."""
    sys.path.insert(0, str(REPO / "jobs"))
    try:
        import bench_checkpoint
    finally:
        sys.path.remove(str(REPO / "jobs"))
    full = bench_checkpoint.shape_params(bench_checkpoint._shape(32, False, None))
    assert full == 8_029_540_352 and bench_checkpoint.shape_params(bench_checkpoint._shape(32, True, None)) == 7_504_568_320
    small = bench_checkpoint._shape(2, False, 16384)
    assert (small["vocab_size"], small["pad_token_id"], small["eos_token_id"]) == (16384, 16382, 16383)
    rows = [{"layers": n, "params": p, **{k: 3.0 + 2e-9 * p for k in
                                          ("checkpoint_bytes", "save_s", "restore_s", "universal_s", "universal_peak_rss_gib")}}
            for n, p in ((1, 352_334_080), (2, 570_446_336))]
    out = bench_checkpoint.extrapolate(rows, 32, full)
    assert out["params"] == full and out["extrapolated_from"] == [[1, 352_334_080], [2, 570_446_336]]
    assert out["universal_s"] == pytest.approx(3.0 + 2e-9 * full, abs=1e-3)
