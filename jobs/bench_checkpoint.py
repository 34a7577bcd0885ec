"""Checkpoint figures: size, save time, check time, restore time and step time, for the fault-tolerance docs.

One process, one worker (no Ray): it builds the model and DeepSpeed engine exactly as a training worker
does (``Worker``'s helpers), trains one step so the optimizer states exist, then times
``save_rank_checkpoint`` (every file a checkpoint holds), ``check_checkpoint`` (what a restart reads
before trusting a checkpoint), ``restore_rank`` (DeepSpeed's load + RNG) and the conversion to
DeepSpeed's universal form that a resume on another worker count runs once per node (``reshard``: its
seconds and the converting process's peak memory). A checkpoint's total size does not depend on the
worker count (ZeRO splits the same optimizer states over more files).

    python jobs/bench_checkpoint.py                          # the tiny model on CPU (fp32, ZeRO-2)
    python jobs/bench_checkpoint.py --gpu --layers 2 4       # Hunyuan-MT-7B width at 2 and 4 layers, bf16,
                                                             # then a straight-line fit in depth to 32 layers

Work lost per failure is at most ``checkpoint.every_steps`` steps (half of it on average) plus the
restart: the step time printed here gives it in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _init_process_group(gpu: bool) -> None:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if gpu:
        torch.cuda.set_device(0)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)


def _model(layers: int | None, gpu: bool, dtype, folder: Path, tied: bool):
    from raytrain_hymt.model import hunyuan_7b_config, load_model
    from raytrain_hymt.tokenizer import RANDOM_PREFIX, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    if layers is None:
        return load_model("tiny", tokenizer, dtype=dtype), tokenizer
    config = folder / f"hunyuan-7b-{layers}l.json"
    config.write_text(json.dumps(hunyuan_7b_config(layers, tie_word_embeddings=tied)))
    return load_model(f"{RANDOM_PREFIX}{config}", tokenizer, dtype=dtype, device="cuda" if gpu else "cpu"), tokenizer


def _train_step(engine, vocab: int, tokens: int, device) -> float:
    import torch

    ids = torch.randint(0, vocab, (1, tokens), device=device)
    started = time.perf_counter()
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss)
    engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(layers: int | None, gpu: bool, precision: str, zero_stage: int, tokens: int, tied: bool,
            universal_dir: str | None = None) -> dict:
    """Figures for one model: bytes, parameters and the seconds of each checkpoint operation.
    ``universal_dir``: where the conversion writes (default: beside the checkpoint, in the temp folder)."""
    import torch

    from raytrain_hymt.checkpoint import RunState, check_checkpoint, restore_rank, save_rank_checkpoint, step_tag
    from raytrain_hymt.config import load_config
    from raytrain_hymt.engine import initialize_engine

    cfg = load_config(None, [f"deepspeed.precision={precision}", f"deepspeed.zero_stage={zero_stage}",
                             f"scaling.use_gpu={str(gpu).lower()}", "scaling.num_workers=1", "optim.max_grad_norm=1.0"])
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    work = Path(tempfile.mkdtemp(prefix="hymt-bench-ckpt-"))
    try:
        model, tokenizer = _model(layers, gpu, dtype, work, tied)
        params = sum(p.numel() for p in model.parameters())
        started = time.perf_counter()
        engine, _ = initialize_engine(model, cfg, 1, 100, on_gpu=gpu)
        build_s = time.perf_counter() - started
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        vocab = model.config.vocab_size
        _train_step(engine, vocab, tokens, device)  # creates the optimizer states
        step_s = min(_train_step(engine, vocab, tokens, device) for _ in range(3))
        state = RunState(step=4, epoch=0, batch_in_epoch=4, world_size=1, tag=step_tag(4), zero_stage=zero_stage)
        started = time.perf_counter()
        folder = save_rank_checkpoint(engine, state, 0, tokenizer)
        save_s = time.perf_counter() - started
        size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        check_s = None
        try:
            import pyarrow.fs
        except ImportError:  # the GPU image may lack pyarrow (FACTS.md); the other figures still stand
            pass
        else:
            started = time.perf_counter()
            check_checkpoint(pyarrow.fs.LocalFileSystem(), folder)
            check_s = round(time.perf_counter() - started, 4)
        started = time.perf_counter()
        restore_rank(engine, folder, 0)
        if gpu:
            torch.cuda.synchronize()
        restore_s = time.perf_counter() - started
        universal_s, universal_gib = _universal_conversion(folder, state.tag, Path(universal_dir or work) / "universal")
        shutil.rmtree(folder, ignore_errors=True)
        return {"layers": layers if layers is not None else model.config.num_hidden_layers,
                "model": "tiny" if layers is None else "hunyuan-mt-7b-width", "params": params,
                "precision": precision, "zero_stage": zero_stage, "checkpoint_bytes": size,
                "bytes_per_param": round(size / params, 2), "save_s": round(save_s, 3), "check_s": check_s,
                "restore_s": round(restore_s, 3), "universal_s": round(universal_s, 3),
                "universal_peak_rss_gib": round(universal_gib, 2), "engine_build_s": round(build_s, 2), "step_s": round(step_s, 3),
                "step_tokens": tokens, "device": torch.cuda.get_device_name(0) if gpu else "cpu"}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _universal_conversion(folder: str, tag: str, out: Path) -> tuple[float, float]:
    """Seconds and peak resident memory (GiB) of ``reshard.convert_to_universal`` in a fresh process with
    one extracting worker: the peak is that process's own, not this one's (which holds the engine)."""
    import multiprocessing
    import resource
    from concurrent.futures import ProcessPoolExecutor

    from raytrain_hymt.reshard import convert_to_universal

    # The conversion writes the fp32 weights and both Adam moments twice (extracted slices, then the
    # universal files): a full disk shows up as torch.save's "unexpected pos" deep inside it.
    need = 2 * sum(f.stat().st_size for f in Path(folder).rglob("*optim_states*"))
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise RuntimeError(f"the universal conversion needs about {need / 2**30:.1f} GiB free in {out.parent}, "
                           f"which has {free / 2**30:.1f} GiB: give --universal-dir on another filesystem")

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        seconds = pool.submit(convert_to_universal, folder, tag, out, 1).result()
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child's peak, in KiB
    shutil.rmtree(out, ignore_errors=True)
    return seconds, peak_kib / 2**20


def extrapolate(rows: list[dict], target: int) -> dict:
    """Straight line through two depths, evaluated at ``target`` layers (everything but the layers is the
    embeddings and head, the same at every depth)."""
    a, b = rows[0], rows[-1]
    out = {"layers": target, "extrapolated_from": [a["layers"], b["layers"]]}
    # The conversion's peak memory too: its extraction loads one rank's whole optimizer file (fp32
    # weights and both Adam moments of that rank's share), which grows with the depth.
    for key in ("params", "checkpoint_bytes", "save_s", "restore_s", "universal_s", "universal_peak_rss_gib"):
        slope = (b[key] - a[key]) / (b["layers"] - a["layers"])
        out[key] = round(a[key] + slope * (target - a["layers"]), 3)
    return out


def main(argv=None) -> int:
    """Measure and print one JSON line per model (and the extrapolation when two depths are given)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="run on GPU 0 (NCCL), bf16 by default")
    p.add_argument("--layers", type=int, nargs="*", default=None,
                   help="depths of the full-width Hunyuan-MT-7B shape to measure (default: the tiny model)")
    p.add_argument("--target-layers", type=int, default=32, help="depth to extrapolate to (two or more --layers)")
    p.add_argument("--tied", action="store_true", help="tie input and output embeddings (Hunyuan-7B; MT-7B is untied)")
    p.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--tokens", type=int, default=None, help="tokens in the timed step (default 4096 GPU, 256 CPU)")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    p.add_argument("--universal-dir", default=None,
                   help="where the universal conversion writes (default: the temp folder of the checkpoint); "
                        "at 7B width it needs about twice the optimizer states' size")
    args = p.parse_args(argv)
    precision = args.precision or ("bf16" if args.gpu else "fp32")
    tokens = args.tokens or (4096 if args.gpu else 256)
    _init_process_group(args.gpu)
    rows = []
    for n in args.layers or [None]:
        try:
            rows.append(measure(n, args.gpu, precision, args.zero_stage, tokens, args.tied, args.universal_dir))
        except Exception as e:  # noqa: BLE001 - one depth that cannot run (memory, disk) must not lose the others
            rows.append({"layers": n, "error": f"{type(e).__name__}: {e}"})
    measured = [r for r in rows if "error" not in r]
    if len(measured) >= 2:
        rows.append(extrapolate(measured, args.target_layers))
    from benchmarks.throughput import print_json_lines

    print_json_lines(rows, args.out)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
