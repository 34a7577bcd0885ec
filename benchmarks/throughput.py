"""GPU throughput benchmark: the project's own training step (``worker.Worker``) on random-init
models, fed by the project's Ray Data pipeline, under TorchTrainer or under plain torchrun.

A *case* is a name plus ``--set``-style overrides on top of the benchmark's base config (:func:`base_overrides`).
Each case trains ``warmup + steps`` optimizer steps; the report covers the last ``steps``: real (non-padding)
tokens per second per GPU over the wall clock of those steps (data waits included), MFU by
``metrics.step_flops`` (per-document attention term) against the datasheet peak, median step time and peak
memory. A case name ending in ``@torchrun`` runs the same case without Ray: the driver hands the very
global batches Ray Data produced to ``torchrun`` workers that run the same :func:`bench_loop` with stand-ins
for Ray Train's context and dataset shard, so the difference is Ray Train's own overhead.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from benchmarks.rank_exit import end_rank

log = logging.getLogger("raytrain_hymt")

TORCHRUN_SUFFIX = "@torchrun"
#: ``preset:NAME``: a case that runs the preset's own settings.
PRESET_CASE = "preset"
#: NVLink multicast stays off on shared GPU hosts (a program that uses it can take the host's GPUs down).
SAFE_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: What a preset changes to run on CPU workers (gloo; smoke runs): no GPU, fp32, sdpa, the GPU-only levers
#: off, one logical CPU per worker.
CPU_PRESET_OVERRIDES = ["scaling.use_gpu=false", "deepspeed.precision=fp32", "model.attn_implementation=sdpa",
                        "model.fused_loss=false", "model.compile=false", "scaling.cpus_per_worker=1"]

_FLEX_PACKED = ["data.packing=true", "model.attn_implementation=flex_attention"]
#: Named cases: the naive recipe first (the baseline; named tutorial-zero3), then one lever at a time.
CASES: dict[str, list[str]] = {
    # The baseline: one pair per row padded to the longest, micro-batch 4, accumulation 4, ZeRO-3.
    "tutorial-zero3": ["data.packing=false", "model.attn_implementation=sdpa", "optim.micro_batch_size=4",
                       "optim.grad_accum=4", "deepspeed.zero_stage=3"],
    # The best plain-DeepSpeed recipe measured earlier: packed 1×4096 rows, flex attention with a document mask.
    "z2-flex-4k-a4": [*_FLEX_PACKED, "optim.micro_batch_size=1", "optim.grad_accum=4", "deepspeed.zero_stage=2"],
    "z2-flex-liger-4k-a4": [*_FLEX_PACKED, "model.fused_loss=true", "optim.micro_batch_size=1",
                            "optim.grad_accum=4", "deepspeed.zero_stage=2"],
    "z2-flex-liger-8k-a4": [*_FLEX_PACKED, "data.pack_tokens=8192", "model.fused_loss=true",
                            "optim.micro_batch_size=1", "optim.grad_accum=4", "deepspeed.zero_stage=2"],
    "z2-flex-liger-4k-a8": [*_FLEX_PACKED, "model.fused_loss=true", "optim.micro_batch_size=1",
                            "optim.grad_accum=8", "deepspeed.zero_stage=2"],
    "z2-flex-liger-compile-4k-a4": [*_FLEX_PACKED, "model.fused_loss=true", "model.compile=true",
                                    "optim.micro_batch_size=1", "optim.grad_accum=4", "deepspeed.zero_stage=2"],
    "z2-flex-liger-compile-8k-a4": [*_FLEX_PACKED, "data.pack_tokens=8192", "model.fused_loss=true",
                                    "model.compile=true", "optim.micro_batch_size=1", "optim.grad_accum=4",
                                    "deepspeed.zero_stage=2"],
    "z2-flex-compile-4k-a8": [*_FLEX_PACKED, "model.compile=true", "optim.micro_batch_size=1",
                              "optim.grad_accum=8", "deepspeed.zero_stage=2"],
    "z2-flex-compile-4k-a16": [*_FLEX_PACKED, "model.compile=true", "optim.micro_batch_size=1",
                               "optim.grad_accum=16", "deepspeed.zero_stage=2"],
    "z2-flex-liger-compile-8k-a8": [*_FLEX_PACKED, "data.pack_tokens=8192", "model.fused_loss=true",
                                    "model.compile=true", "optim.micro_batch_size=1", "optim.grad_accum=8",
                                    "deepspeed.zero_stage=2"],
    "z3-flex-liger-8k-a4": [*_FLEX_PACKED, "data.pack_tokens=8192", "model.fused_loss=true",
                            "optim.micro_batch_size=1", "optim.grad_accum=4", "deepspeed.zero_stage=3"],
    # CPU smoke shape (tests): packed rows through sdpa's dense document mask.
    "cpu-packed": ["data.packing=true", "model.attn_implementation=sdpa", "optim.micro_batch_size=1",
                   "optim.grad_accum=2"],
}


@dataclass
class Case:
    """One benchmark configuration: its name, overrides, and whether it runs under torchrun."""

    name: str
    overrides: list[str]
    torchrun: bool = False
    preset: str | None = None
    """Run this preset's own settings (only the benchmark's bookkeeping below is overridden)."""


def print_json_lines(rows: list[dict], out: str | None = None) -> None:
    """Print one JSON line per row (a benchmark's results), and write them to ``out`` too when given."""
    lines = [json.dumps(r) for r in rows]
    print("\n".join(lines))
    if out:
        Path(out).write_text("\n".join(lines) + "\n")


def parse_case(spec: str) -> Case:
    """``NAME`` (one of :data:`CASES`), ``NAME:a.b=v,c.d=w`` (a new case), ``preset:PRESET[,a.b=v]`` (the
    preset's own settings, e.g. ``preset:hy-mt-7b-lora``), each optionally with ``@torchrun``."""
    torchrun = spec.endswith(TORCHRUN_SUFFIX)
    body = spec[: -len(TORCHRUN_SUFFIX)] if torchrun else spec
    name, _, extra = body.partition(":")
    if name == PRESET_CASE:
        preset, *more = extra.split(",")
        return Case(spec, [o for o in more if o], torchrun, preset=preset)
    if extra:
        return Case(spec, [o for o in extra.split(",") if o], torchrun)
    if name not in CASES:
        raise ValueError(f"--case {spec!r}: unknown case {name!r}; known: {', '.join(CASES)} (or NAME:a.b=v,...)")
    return Case(spec, list(CASES[name]), torchrun)


def bookkeeping_overrides(model: str, steps_total: int, workers: int, storage: str) -> list[str]:
    """What every case overrides, preset cases included: the model folder, the step count, the workers,
    no tracking/export/restarts, and data that repeats freely (the sample is repeated to fill the steps;
    dedup would drop the repeats again)."""
    return [
        f"model.name_or_path={model}", "model.tokenizer=null", f"scaling.num_workers={workers}",
        f"optim.max_steps={steps_total}", "tracking.enabled=false", "run.export=false",
        "checkpoint.max_failures=0", f"checkpoint.every_steps={10**6}", f"eval.every_steps={10**6}",
        f"run.storage_root={storage}", "data.dedup=false", "data.sources=[{path: 'sample:'}]",
        "data.prepared_path=null",
    ]


def base_overrides(model: str, steps_total: int, workers: int, use_gpu: bool, storage: str) -> list[str]:
    """Settings the named cases share on top of the bookkeeping: precision, a constant rate, 4096-token rows."""
    gpu = [f"scaling.use_gpu={str(use_gpu).lower()}", f"deepspeed.precision={'bf16' if use_gpu else 'fp32'}"]
    return [
        *bookkeeping_overrides(model, steps_total, workers, storage), *gpu,
        "optim.warmup_steps=0", "optim.schedule=constant",
        "data.pack_tokens=4096", "data.max_example_tokens=256", "data.val_fraction=0.02",
    ]


def summarize(steps: list[dict], warmup: int, world: int, peak_flops: float | None) -> dict:
    """Headline figures of the steps after ``warmup`` (each: ``wall_s``, ``step_s``, ``tokens``, ``flops``,
    ``padded_tokens``). Throughput divides by the wall clock, so data waits between steps count."""
    measured = steps[warmup:]
    if not measured:
        raise ValueError(f"no steps measured: {len(steps)} steps run, {warmup} of them warm-up")
    wall = sum(s["wall_s"] for s in measured)
    tokens = sum(s["tokens"] for s in measured)
    flops = sum(s["flops"] for s in measured)
    out = {
        "steps_measured": len(measured),
        "tokens_per_s_per_gpu": tokens / wall / world,
        "step_time_s_median": statistics.median(s["step_s"] for s in measured),
        "wall_per_step_s": wall / len(measured),
        "tokens_per_step": tokens / len(measured),
        "padding_fraction": 1.0 - tokens / max(1.0, sum(s["padded_tokens"] for s in measured)),
    }
    # The FLOPs come back from the workers' MFU metric, which needs the device's peak (unknown on a CPU).
    out["tflops_per_gpu"] = flops / wall / world / 1e12 if peak_flops else None
    out["mfu"] = flops / (wall * world * peak_flops) if peak_flops else None
    return out


def markdown_table(results: list[dict]) -> str:
    """The results as a Markdown table (one row per case; failed cases show their error)."""
    head = ("| case | launcher | ZeRO | layout | micro × accum | real tok/s/GPU | MFU | step s (median) | "
            "peak GiB | tokens/step |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        if "error" in r:
            rows.append(f"| {r['case']} | {r.get('launcher', '')} | | | | failed: {r['error'][:80]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        rows.append(
            f"| {r['case']} | {r['launcher']} | {r['zero_stage']} | {r['layout']} | {r['micro_batch']} × "
            f"{r['grad_accum']} | {r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {r['step_time_s_median']:.3f} | "
            f"{r['peak_memory_gib']:.1f} | {r['tokens_per_step']:,.0f} |"
        )
    return "\n".join([head, *rows])


# --- the per-worker loop (Ray Train worker or torchrun rank) -------------------------------------------


class StandInContext:
    """The rank and world size ``ray.train.get_context()`` gives, from torch.distributed (torchrun mode)."""

    def get_world_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def get_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()


@dataclass
class StandInShard:
    """What the loop asks of a Ray dataset shard: the global batches Ray Data produced, replayed."""

    batches: list[dict] = field(default_factory=list)

    def iter_batches(self, **_ignored):
        return iter(self.batches)


def bench_loop(loop_config: dict, context=None, shard=None) -> None:
    """Train ``warmup + steps`` steps with ``Worker.train_step``; rank 0 writes the result JSON."""
    import torch
    import torch.distributed as dist

    from raytrain_hymt.data.epochs import rank_rows
    from raytrain_hymt.train.worker import LoopInputs, Worker

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bench = loop_config.pop("bench")
    if context is None:
        import ray.train

        context = ray.train.get_context()
    w = Worker(LoopInputs(**loop_config), context.get_world_rank(), context.get_world_size())
    t_build = time.perf_counter()
    # Nothing to resume: a torchrun rank has no Ray Train checkpoint to ask about.
    w.build(load_universal=False)
    build_s = time.perf_counter() - t_build
    if shard is None:
        import ray.train

        shard = ray.train.get_dataset_shard("train")
    opt = w.cfg.optim
    global_rows = w.world * opt.grad_accum * opt.micro_batch_size
    batches = shard.iter_batches(batch_size=global_rows, batch_format="numpy", drop_last=True, prefetch_batches=2)
    mine = lambda batch: rank_rows(batch, w.rank, w.world, opt.grad_accum, opt.micro_batch_size)  # noqa: E731
    steps = []
    last = time.perf_counter()
    for global_batch in batches:
        m = w.train_step(mine(global_batch))
        now = time.perf_counter()
        seconds = m["train/step_time_s"]
        # An integer count recovered from a rate: rounding removes the float error (1954.0000000000002)
        # so that the same batches give the same count under both launchers.
        tokens = round(m["train/tokens_per_s_per_worker"] * seconds * w.world)
        flops = (m.get("train/mfu") or 0.0) * seconds * w.world * (w.peak or 0.0)
        steps.append({"wall_s": now - last, "step_s": seconds, "tokens": tokens, "flops": flops,
                      "padded_tokens": _padded_tokens(w.cfg, global_batch), "loss": m["train/loss"]})
        last = now
        if w.rank == 0:
            log.info("bench %s step %d: %.3f s, %.0f tok/s/GPU, loss %.3f", bench["case"], len(steps), seconds,
                     m["train/tokens_per_s_per_worker"], m["train/loss"])
        if len(steps) >= bench["warmup"] + bench["steps"]:
            break
    profile = None
    if bench.get("profile") and w.device.type == "cuda":  # one more step, under the profiler, not timed above
        from benchmarks.profile_step import profile_call

        _, profile = profile_call(w.train_step, mine(next(iter(batches))))
    peak = torch.tensor([m["train/memory_gib"], m.get("train/memory_reserved_gib", 0.0)], dtype=torch.float64,
                        device=w.device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if w.rank == 0:
        result = summarize(steps, bench["warmup"], w.world, w.peak)
        cfg = w.cfg
        result.update({
            "case": bench["case"], "launcher": bench["launcher"], "world": w.world,
            "zero_stage": cfg.deepspeed.zero_stage, "micro_batch": opt.micro_batch_size, "grad_accum": opt.grad_accum,
            "layout": (f"packed {cfg.data.pack_tokens}" if cfg.data.packing else "padded") + f" {cfg.model.attn_implementation}",
            "fused_loss": cfg.model.fused_loss, "compile": cfg.model.compile,
            "activation_checkpointing": cfg.deepspeed.activation_checkpointing,
            "params": w.shape[0], "layers": w.shape[1], "peak_memory_gib": float(peak[0]),
            "peak_reserved_gib": float(peak[1]) if "train/memory_reserved_gib" in m else None,
            "lora": cfg.lora.enabled, "preset": cfg.preset,
            "build_s": build_s, "device": torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else "cpu",
            "losses": [s["loss"] for s in steps], "step_times_s": [s["step_s"] for s in steps],
            "wall_times_s": [s["wall_s"] for s in steps], "overrides": bench["overrides"],
            **({"profile": profile} if profile else {}),
        })
        Path(bench["result_path"]).write_text(json.dumps(result))


def _padded_tokens(cfg, global_batch: dict) -> float:
    """Token slots this step computed, padding included (rows padded as ``Worker.collate`` pads them)."""
    rows = len(global_batch["input_ids"])
    if cfg.data.packing and cfg.model.attn_implementation == "flex_attention":
        return float(rows * cfg.data.pack_tokens)
    b = cfg.optim.micro_batch_size
    lengths = [len(r) for r in global_batch["input_ids"]]
    # Each micro-batch pads to its longest row (rounded up to 8).
    return float(sum(-(-max(lengths[i : i + b]) // 8) * 8 * len(lengths[i : i + b]) for i in range(0, rows, b)))


def _torchrun_worker(spec_path: str) -> NoReturn:
    """Entry of one torchrun rank (``python -m torch.distributed.run ... -m benchmarks.throughput SPEC``)."""
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    if spec["use_gpu"]:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    dist.init_process_group("nccl" if spec["use_gpu"] else "gloo")
    with open(spec["batches_path"], "rb") as f:
        batches = pickle.load(f)
    bench_loop(spec["loop_config"], context=StandInContext(), shard=StandInShard(batches))
    # Only after success: a failed rank raises and torchrun stops its peers; a destroy_process_group while
    # a peer still waits in a collective can hang (torchtitan's train.py destroys only after success too).
    end_rank()


# --- the driver ----------------------------------------------------------------------------------------


def model_folder(shape: str, layers: int, tied: bool, workdir: Path, use_gpu: bool, folder: str | None = None) -> str:
    """The benchmark model as a model folder that ``from_pretrained`` loads, exactly as ``hymt train``
    loads a real one (a model built from its config would train in train mode and hide what a loaded one
    does): ``folder`` when given and present, else a random-init one written once (the tiny shape, or the
    Hunyuan-7B shape with ``layers`` layers, in bf16) to ``folder`` or under ``workdir``."""
    from raytrain_hymt.train.model import hunyuan_7b_config, load_model
    from raytrain_hymt.tokenizer import RANDOM_PREFIX, TINY_MODEL, load_tokenizer

    if shape not in ("7b", "tiny"):
        raise ValueError(f"--shape {shape!r}: expected 7b or tiny")
    name = "tiny" if shape == "tiny" else f"hunyuan-7b-{layers}l-{'tied' if tied else 'untied'}"
    target = Path(folder) if folder else workdir / name
    if (target / "config.json").exists():
        return str(target)
    import torch

    tok = load_tokenizer(TINY_MODEL)
    if shape == "tiny":
        model = load_model(TINY_MODEL, tok)
    else:
        spec = workdir / f"{name}.json"
        spec.write_text(json.dumps(hunyuan_7b_config(layers=layers, tie_word_embeddings=tied)))
        model = load_model(f"{RANDOM_PREFIX}{spec}", tok, dtype=torch.bfloat16, device="cuda" if use_gpu else "cpu")
    model.save_pretrained(target)
    tok.save_pretrained(target)
    del model
    return str(target)


def repeat_sources(cfg, copies: int) -> None:
    """Read every source ``copies`` times (their ``weight``), so the corpus fills the benchmark's steps.
    Repeating at the source keeps every block of the final dataset distinct (a union of one materialized
    dataset with itself repeats block references, which Ray Data's prefetcher rejects)."""
    cfg.data.sources = [s.model_copy(update={"weight": s.weight * copies}) for s in cfg.data.sources]


def _datasets(cfg, cache: dict, needed_rows: int):
    """``build_datasets(cfg)``, with the sources repeated until there are ``needed_rows`` training rows;
    cached per data config (cases that share one reuse it)."""
    from raytrain_hymt.data.pipeline import build_datasets

    def build():
        key = json.dumps(cfg.data.model_dump(mode="json"), sort_keys=True)
        if key not in cache:
            cache[key] = build_datasets(cfg)
        return cache[key]

    train, val, stats = build()
    if stats.train_rows < needed_rows:
        repeat_sources(cfg, -(-needed_rows // max(stats.train_rows, 1)) + 1)  # +1: packs of a repeat vary
        train, val, stats = build()
    return train, val, stats


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _run_ray(cfg, train, val, loop_inputs: dict) -> None:
    from raytrain_hymt.driver.train import build_trainer

    build_trainer(cfg, train, val, loop_inputs, loop=bench_loop, train_shard=True).fit()


def _run_torchrun(cfg, train, loop_inputs: dict, workdir: Path, global_rows: int, count: int) -> None:
    """The same loop under torchrun, on the very global batches Ray Data produces for the Ray case."""
    batches = []
    for batch in train.iter_batches(batch_size=global_rows, batch_format="numpy", drop_last=True):
        batches.append(batch)
        if len(batches) == count:
            break
    stem = workdir / _slug(loop_inputs["bench"]["case"])
    batches_path = stem.with_suffix(".batches.pkl")
    with open(batches_path, "wb") as f:
        pickle.dump(batches, f)
    spec_path = stem.with_suffix(".spec.json")
    spec_path.write_text(json.dumps({"use_gpu": cfg.scaling.use_gpu, "batches_path": str(batches_path),
                                     "loop_config": loop_inputs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cfg.scaling.num_workers}",
           "-m", "benchmarks.throughput", str(spec_path)]
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited with {done.returncode} (see the log above)")


def run_benchmark(case_specs: list[str], *, shape: str = "7b", layers: int = 32, tied: bool = True,
                  steps: int = 10, warmup: int = 3, workers: int = 2, use_gpu: bool = True,
                  out_dir: str | Path = "bench_out", extra: list[str] = (), model_dir: str | None = None,
                  profile: bool = False) -> list[dict]:
    """Run every case in turn; append one JSON line per case to ``<out_dir>/results.jsonl`` and write
    ``<out_dir>/table.md``. A failing case (e.g. out of memory) is recorded with its error; the rest run.
    ``profile``: one more step per case under ``torch.profiler`` (GPU), summarised in the case's ``profile``
    (:mod:`benchmarks.profile_step`)."""
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.driver.session import init_ray

    cases = [parse_case(s) for s in case_specs]
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if use_gpu:
        for key, value in SAFE_GPU_ENV.items():  # inherited by Ray's and torchrun's workers
            os.environ.setdefault(key, value)
    model = model_folder(shape, layers, tied, out, use_gpu, model_dir)
    data_cache: dict[str, tuple] = {}
    results = []
    for case in cases:
        if case.preset:  # the preset as users run it: only the bookkeeping (and --set) changes
            overrides = bookkeeping_overrides(model, warmup + steps, workers, str(out / "runs"))
            if not use_gpu:
                overrides += CPU_PRESET_OVERRIDES
        else:
            overrides = base_overrides(model, warmup + steps, workers, use_gpu, str(out / "runs"))
        cfg = load_config(case.preset, [*overrides, *case.overrides, *extra])
        cfg.run.name = f"bench-{_slug(case.name)}-{int(time.time())}"
        init_ray(cfg)
        opt = cfg.optim
        global_rows = workers * opt.grad_accum * opt.micro_batch_size
        needed = global_rows * (warmup + steps + int(profile))
        train, val, stats = _datasets(cfg, data_cache, needed)
        result_path = out / f"{_slug(case.name)}.result.json"
        result_path.unlink(missing_ok=True)
        loop_inputs = {
            "config": cfg.model_dump(mode="json"), "train_rows": stats.train_rows, "tracking_run_id": None,
            "tracking_uri": None, "run_dir": str(out / "runs"),
            "bench": {"case": case.name, "launcher": "torchrun" if case.torchrun else "ray-train",
                      "warmup": warmup, "steps": steps, "result_path": str(result_path), "profile": profile,
                      "overrides": case.overrides},
        }
        log.info("case %s: %s", case.name, " ".join(case.overrides))
        started = time.time()
        try:
            if case.torchrun:
                _run_torchrun(cfg, train, loop_inputs, out, global_rows, needed // global_rows)
            else:
                _run_ray(cfg, train, val, loop_inputs)
            result = json.loads(result_path.read_text())
        except Exception as e:  # one failed case (out of memory, say) must not lose the others
            log.exception("case %s failed", case.name)
            result = {"case": case.name, "launcher": loop_inputs["bench"]["launcher"], "error": f"{type(e).__name__}: {e}"}
        result["case_wall_s"] = time.time() - started
        result["data"] = {"train_examples": stats.train_examples, "train_rows": stats.train_rows,
                          "mean_example_tokens": stats.train_tokens / max(stats.train_examples, 1)}
        results.append(result)
        line = json.dumps(result)
        print(line, flush=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(line + "\n")
        (out / "table.md").write_text(markdown_table(results) + "\n")
    return results


def document_mask_check(device: str = "cuda", attn_implementation: str = "flex_attention") -> float:
    """Largest |logit difference| between three pairs packed in one row (document mask) and the same
    pairs run one by one, on the tiny random model in fp32: ~1e-6 means the mask is right, ~0.1 wrong."""
    import numpy as np
    import torch

    from raytrain_hymt.data.packing import collate, pack_examples
    from raytrain_hymt.train.model import load_model
    from raytrain_hymt.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    model = load_model("tiny", tok, dtype=torch.float32, attn_implementation=attn_implementation).to(device).eval()
    rng = np.random.default_rng(0)
    ids = [rng.integers(10, 1000, n) for n in (37, 90, 61)]
    examples = {"input_ids": np.array(ids, dtype=object), "labels": np.array(ids, dtype=object),
                "example_id": np.arange(3)}
    pad_to = 256 if attn_implementation == "flex_attention" else None  # flex needs a multiple of its block

    def logits(rows):
        b = collate(rows, pad_token_id=tok.pad_token_id, attn_implementation=attn_implementation, device=device,
                    pad_to=pad_to)
        with torch.no_grad():
            return model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                         attention_mask=b["attention_mask"], use_cache=False).logits
    packed = logits(pack_examples(examples, 256))[0]
    worst, start = 0.0, 0
    for i, a in enumerate(ids):
        single = {k: v[i : i + 1] for k, v in examples.items()}
        alone = logits(pack_examples(single, 256))[0, : a.size]
        worst = max(worst, float((packed[start : start + a.size] - alone).abs().max()))
        start += a.size
    return worst


if __name__ == "__main__":
    _torchrun_worker(sys.argv[1])
