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
    assert s["tflops_per_gpu"] == pytest.approx(8e12 / 4 / 2 / 1e12)
    unknown_peak = summarize(steps, 1, 2, None)
    assert unknown_peak["mfu"] is None and unknown_peak["tflops_per_gpu"] is None
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


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def _floats(n: int):
    return lambda v: isinstance(v, list) and len(v) == n and all(isinstance(x, float) for x in v)


def _is(*types):
    return lambda v: isinstance(v, types) and not (bool not in types and isinstance(v, bool))


def _none(v) -> bool:
    return v is None


def check_fields(result: dict, schema: dict) -> None:
    """Every field of ``schema`` present with a value its check accepts, and no field besides."""
    assert sorted(result) == sorted(schema), (sorted(set(result) ^ set(schema)), result)
    def accepted(key: str) -> bool:
        try:
            return bool(schema[key](result[key]))
        except TypeError:  # None, or a list where a number belongs
            return False

    wrong = {k: result[k] for k in schema if not accepted(k)}
    assert not wrong, wrong


def _benchmark_fields(launcher: str, preset: str | None, micro: int, accum: int, steps: int, warmup: int) -> dict:
    """jobs/benchmark.py's line of one CPU case. CPU: no peak FLOP/s, so MFU and TFLOP/s are None; the
    memory is the worker's resident size, and there is no reserved figure."""
    return {
        "steps_measured": lambda v: v == steps, "tokens_per_s_per_gpu": _positive, "step_time_s_median": _positive,
        "wall_per_step_s": _positive, "tokens_per_step": _positive, "padding_fraction": lambda v: 0 <= v < 0.5,
        "tflops_per_gpu": _none, "mfu": _none, "case": _is(str), "launcher": lambda v: v == launcher,
        "world": lambda v: v == 2, "zero_stage": lambda v: v == 2, "micro_batch": lambda v: v == micro,
        "grad_accum": lambda v: v == accum, "layout": _is(str), "fused_loss": lambda v: v is False,
        "compile": lambda v: v is False, "activation_checkpointing": _is(bool), "params": lambda v: v == 1_303_936,  # what MFU counts
        "layers": lambda v: v == 4, "peak_memory_gib": lambda v: 0.1 < v < 16, "peak_reserved_gib": _none,
        "lora": lambda v: v is False, "preset": lambda v: v == preset, "build_s": _positive,
        "device": lambda v: v == "cpu", "losses": _floats(steps + warmup), "step_times_s": _floats(steps + warmup),
        "wall_times_s": _floats(steps + warmup), "overrides": _is(list), "case_wall_s": _positive,
        "data": lambda v: sorted(v) == ["mean_example_tokens", "train_examples", "train_rows"]
        and all(_positive(x) for x in v.values()),
    }


def _user_run(args: list[str], ray_session, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python jobs/...`` as a user runs it, joined to the test session's Ray (RAY_ADDRESS), with the quiet
    console (no worker line reaches it, so no figure can come from one)."""
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address, HYMT_VERBOSE="",
               PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])
    return done


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_benchmark_job_reports_every_field_and_ray_train_and_torchrun_agree(ray_session, tmp_path):
    """jobs/benchmark.py on CPU at the tiny shape: one case under TorchTrainer, the same under torchrun (same
    batches, same losses), and a preset case; every field of each JSON line checked."""
    out = tmp_path / "bench"
    done = _user_run(["jobs/benchmark.py", "--cpu", "--shape", "tiny", "--steps", "2", "--warmup", "1",
                      "--workers", "2", "--out", str(out), "--set", "data.pack_tokens=512", "--case", "cpu-packed",
                      "--case", "cpu-packed@torchrun", "--case", "preset:tiny-cpu"], ray_session)
    results = _json_lines(done.stdout)
    assert [r["case"] for r in results] == ["cpu-packed", "cpu-packed@torchrun", "preset:tiny-cpu"]
    ray_r, torchrun_r, preset_r = results
    # The named cases build on the default preset (tiny-cpu) too.
    check_fields(ray_r, _benchmark_fields("ray-train", "tiny-cpu", 1, 2, 2, 1))
    check_fields(torchrun_r, _benchmark_fields("torchrun", "tiny-cpu", 1, 2, 2, 1))
    # The model is a folder loaded through from_pretrained, as `hymt train` loads one; a preset case keeps
    # the preset's own settings (tiny-cpu: micro-batch 2, its warmup and cosine schedule).
    check_fields(preset_r, _benchmark_fields("ray-train", "tiny-cpu", 2, 1, 2, 1))
    assert (out / "tiny" / "config.json").exists() and (out / "tiny" / "tokenizer.json").exists()
    for r in (ray_r, torchrun_r):
        assert r["layout"] == "packed 512 sdpa" and 0 <= r["padding_fraction"] < 0.2
    # The torchrun ranks replay exactly the global batches Ray Data produced: identical work and losses.
    assert torchrun_r["tokens_per_step"] == ray_r["tokens_per_step"]
    assert torchrun_r["losses"] == pytest.approx(ray_r["losses"], rel=1e-5)
    assert [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()] == results
    table = (out / "table.md").read_text()
    assert "| cpu-packed | ray-train | 2 | packed 512 sdpa | 1 × 2 |" in table
    assert "| cpu-packed@torchrun | torchrun |" in table


def test_real_model_job_reports_every_field_from_what_the_workers_wrote(ray_session, tmp_path):
    """jobs/bench_real_model.py runs ``hymt train`` of the LoRA preset the README measures, on CPU at the
    tiny shape. CPU: memory is the worker's resident size and there is no reserved figure; MFU is None
    (no peak FLOP/s); the GPU fields' parsing is checked by ``test_run_figures_of_a_gpu_run``."""
    out = tmp_path / "real"
    done = _user_run(["jobs/bench_real_model.py", "--preset", "hy-mt-7b-lora-fast", "--shape", "tiny", "--cpu",
                      "--steps", "2", "--model-dir", str(tmp_path / "model"), "--out", str(out)], ray_session)
    (result,) = _json_lines(done.stdout.splitlines()[-1])
    check_fields(result, {
        "preset": lambda v: v == "hy-mt-7b-lora-fast", "shape": lambda v: v == "tiny", "layers": _is(int),
        "untied": lambda v: v is False, "steps": lambda v: v == 2, "workers": lambda v: v == 1,
        "device": lambda v: v == "cpu", "exit_code": lambda v: v == 0, "wall_s": _positive,
        "model_write_s": _positive, "driver_peak_rss_gib": lambda v: 0.1 < v < 4,
        "base_safetensors_bytes": _positive, "steps_logged": lambda v: v == 2, "steps_done": lambda v: v == 2,
        "train_loss": _positive, "max_memory_allocated_gib": lambda v: 0.1 < v < 16,
        "max_memory_reserved_gib": _none, "tokens_per_s_per_gpu_last": _positive,
        "tokens_per_s_per_gpu_median": _positive, "mfu_last": _none, "mfu_median": _none,
        "export_s": lambda v: 0 < v < result["wall_s"], "checkpoint_bytes": _positive,
        # LoRA: the checkpoint holds the adapters and their optimizer state, not the frozen base.
        "checkpoint_fraction_of_base": lambda v: 0 < v < 1,
        # The merged export is a whole model in fp32, as large as the base folder.
        "export_bytes": lambda v: v > 0.9 * result["base_safetensors_bytes"],
    })
    assert json.loads((out / "real_model.jsonl").read_text()) == result


def test_run_figures_of_a_gpu_run(tmp_path):
    """What ``benchmarks.run_figures`` reads from a GPU run's metrics.jsonl (written here as rank 0's tracker
    writes it, a resumed step logged twice): peaks, the last and the steady (after step 1) rates, MFU, export."""
    from benchmarks.run_figures import run_figures
    from raytrain_hymt.tracking.metrics_log import MetricsLog

    run = tmp_path / "r"
    log = MetricsLog(run)
    for step, (mem, reserved, rate, mfu) in enumerate([(20.0, 21.0, 100.0, 0.1), (21.5, 22.2, 900.0, 0.4),
                                                       (21.0, 22.0, 1000.0, 0.5), (21.0, 22.1, 800.0, 0.3)], 1):
        log.write("metric", [("train/loss", 2.0, step), ("train/memory_gib", mem, step),
                             ("train/memory_reserved_gib", reserved, step),
                             ("train/tokens_per_s_per_worker", rate, step), ("train/mfu", mfu, step)], 0.0)
    log.write("metric", [("train/tokens_per_s_per_worker", 700.0, 4), ("export/seconds", 19.0, 4)], 0.0)
    log.close()
    (run / "checkpoint_step00000002").mkdir()
    (run / "checkpoint_step00000004").mkdir()
    (run / "checkpoint_step00000004" / "shard").write_bytes(b"x" * 300)
    figures = run_figures(tmp_path, "r")
    assert figures == {
        "steps_logged": 4, "steps_done": None, "train_loss": None, "max_memory_allocated_gib": 21.5,
        "max_memory_reserved_gib": 22.2, "tokens_per_s_per_gpu_last": 700.0, "tokens_per_s_per_gpu_median": 900.0,
        "mfu_last": 0.3, "mfu_median": 0.4, "export_s": 19.0, "checkpoint_bytes": 300, "export_bytes": None,
    }


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
