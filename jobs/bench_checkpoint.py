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
                                                             # then a straight-line fit to the 32-layer model
    python jobs/bench_checkpoint.py --layers 1 2 --vocab 16384   # the same width on a CPU machine that
                                                             # cannot hold the 128k vocabulary's embeddings

The fit is a straight line in the parameter count through the measured models, evaluated at the full
model's (Hunyuan-MT-7B: 32 layers, 128,167-token vocabulary, untied: 8.03 B): a checkpoint and its
conversion handle every parameter's fp32 weight and Adam moments alike, so seconds and bytes follow
the parameters, whether they sit in layers or in the embeddings.

Work lost per failure is at most ``checkpoint.every_steps`` steps (half of it on average) plus the
restart: the step time printed here gives it in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ports import free_port  # noqa: E402


def _init_process_group(gpu: bool, rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if gpu:
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)


def _shape(layers: int, tied: bool, vocab: int | None) -> dict:
    """config.json of the Hunyuan-MT-7B width at ``layers``; ``vocab``: a smaller vocabulary (its special
    tokens moved inside it)."""
    from raytrain_hymt.train.model import hunyuan_7b_config

    small = {} if vocab is None else {"vocab_size": vocab, "pad_token_id": vocab - 2, "eos_token_id": vocab - 1}
    return hunyuan_7b_config(layers, tie_word_embeddings=tied, **small)


def shape_params(shape: dict) -> int:
    """Parameters of a model of ``shape`` (built on the meta device: no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(shape)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def _model(layers: int | None, gpu: bool, dtype, folder: Path, tied: bool, vocab: int | None):
    from raytrain_hymt.train.model import load_model
    from raytrain_hymt.tokenizer import RANDOM_PREFIX, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    if layers is None:
        return load_model("tiny", tokenizer, dtype=dtype), tokenizer
    config = folder / f"hunyuan-7b-{layers}l.json"
    config.write_text(json.dumps(_shape(layers, tied, vocab)))
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


def _checkpoint_figures(rank: int, world: int, port: int, layers: int | None, gpu: bool, precision: str,
                        zero_stage: int, tokens: int, tied: bool, vocab: int | None, work: str) -> dict:
    """One rank of ``world``: build, train, save, check and restore one model (in a process of its own:
    see :func:`measure`); its figures, and the folder of its part of the checkpoint and the ``tag``. With
    several ranks only rank 0 checks and restores, from its own folder (the others' files are elsewhere)."""
    import torch

    from raytrain_hymt.train.checkpoint import RunState, check_checkpoint, restore_rank, save_rank_checkpoint, step_tag
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.train.engine import initialize_engine

    _init_process_group(gpu, rank, world, port)
    cfg = load_config(None, [f"deepspeed.precision={precision}", f"deepspeed.zero_stage={zero_stage}",
                             f"scaling.use_gpu={str(gpu).lower()}", f"scaling.num_workers={world}",
                             "optim.max_grad_norm=1.0"])
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    model, tokenizer = _model(layers, gpu, dtype, Path(work), tied, vocab)
    params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    engine, _ = initialize_engine(model, cfg, world, 100, on_gpu=gpu)
    build_s = time.perf_counter() - started
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    vocab_size = model.config.vocab_size
    _train_step(engine, vocab_size, tokens, device)  # creates the optimizer states
    step_s = min(_train_step(engine, vocab_size, tokens, device) for _ in range(3))
    state = RunState(step=4, epoch=0, batch_in_epoch=4, world_size=world, tag=step_tag(4), zero_stage=zero_stage)
    started = time.perf_counter()
    folder = save_rank_checkpoint(engine, state, rank, tokenizer)
    save_s = time.perf_counter() - started
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    check_s = restore_s = None
    try:
        import pyarrow.fs
    except ImportError:  # the GPU image may lack pyarrow; the other figures still stand
        pyarrow = None
    if pyarrow is not None and world == 1:
        started = time.perf_counter()
        check_checkpoint(pyarrow.fs.LocalFileSystem(), folder)
        check_s = round(time.perf_counter() - started, 4)
    if world == 1:
        started = time.perf_counter()
        restore_rank(engine, folder, 0)
        if gpu:
            torch.cuda.synchronize()
        restore_s = round(time.perf_counter() - started, 3)
    return {"layers": model.config.num_hidden_layers, "model": "tiny" if layers is None else "hunyuan-mt-7b-width",
            "vocab": vocab_size, "params": params, "precision": precision, "zero_stage": zero_stage,
            "world": world, "checkpoint_bytes": size, "bytes_per_param": round(size / params, 2),
            "save_s": round(save_s, 3), "check_s": check_s, "restore_s": restore_s, "engine_build_s": round(build_s, 2),
            "step_s": round(step_s, 3), "step_tokens": tokens,
            "device": torch.cuda.get_device_name(0) if gpu else "cpu", "folder": folder, "tag": state.tag}


def _spawned(fn, *args, processes: int = 1) -> list:
    """``fn(i, *args)`` for i in range(``processes``), each in a fresh process at the same time (spawned:
    no CUDA or process group inherited); their results."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, i, *args) for i in range(processes)]
        return [f.result() for f in futures]


def _merge_rank_folders(folders: list[str]) -> str:
    """Move every rank's checkpoint files into rank 0's folder, as the run folder holds them."""
    for folder in folders[1:]:
        for f in Path(folder).rglob("*"):
            target = Path(folders[0], f.relative_to(folder))
            if f.is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(f), target)
        shutil.rmtree(folder, ignore_errors=True)
    return folders[0]


def measure(layers: int | None, gpu: bool, precision: str, zero_stage: int, tokens: int, tied: bool,
            universal_dir: str | None = None, vocab: int | None = None, world: int = 1) -> dict:
    """Figures for one model saved by ``world`` ranks: bytes, parameters and the seconds of each
    checkpoint operation (rank 0's). ``universal_dir``: where the conversion writes (default: beside the
    checkpoint, in the temp folder).

    The engine and the conversion run in processes of their own, one after the other: the conversion
    gets the memory the engine held (on a CPU machine both would not fit) and its peak is its own."""
    work = Path(tempfile.mkdtemp(prefix="hymt-bench-ckpt-"))
    try:
        ranks = _spawned(_checkpoint_figures, world, free_port(), layers, gpu, precision, zero_stage, tokens, tied,
                         vocab, str(work), processes=world)
        row, tag = ranks[0], ranks[0].pop("tag")
        folder = _merge_rank_folders([r.pop("folder") for r in ranks])
        row["checkpoint_bytes"] = sum(r["checkpoint_bytes"] for r in ranks)
        row["bytes_per_param"] = round(row["checkpoint_bytes"] / row["params"], 2)
        try:
            universal_s, universal_gib = _universal_conversion(folder, tag, Path(universal_dir or work) / "universal")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {**row, "universal_s": round(universal_s, 3), "universal_peak_rss_gib": round(universal_gib, 2)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _convert(_, folder: str, tag: str, out: Path) -> tuple[float, float]:
    """``reshard.convert_to_universal`` with one extracting worker: its seconds, and the peak resident
    memory (GiB) of this process and of the workers it started."""
    import resource

    from raytrain_hymt.train.checkpoint import convert_to_universal

    seconds = convert_to_universal(folder, tag, out, 1)
    peak_kib = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return seconds, peak_kib / 2**20


def _universal_conversion(folder: str, tag: str, out: Path) -> tuple[float, float]:
    """Seconds and peak resident memory (GiB) of the conversion to the universal form, in a fresh process."""
    # The conversion writes the fp32 weights and both Adam moments twice (extracted slices, then the
    # universal files): a full disk shows up as torch.save's "unexpected pos" deep inside it.
    need = 2 * sum(f.stat().st_size for f in Path(folder).rglob("*optim_states*"))
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise RuntimeError(f"the universal conversion needs about {need / 2**30:.1f} GiB free in {out.parent}, "
                           f"which has {free / 2**30:.1f} GiB: give --universal-dir on another filesystem")
    try:
        return _spawned(_convert, folder, tag, out)[0]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def extrapolate(rows: list[dict], target: int, target_params: int) -> dict:
    """Straight line in the parameter count through the first and last measured models, evaluated at
    ``target_params`` (the model of ``target`` layers)."""
    a, b = rows[0], rows[-1]
    out = {"layers": target, "params": target_params, "extrapolated_from": [[r["layers"], r["params"]] for r in (a, b)]}
    # The conversion's peak memory too: its extraction loads one rank's whole optimizer file (fp32
    # weights and both Adam moments of that rank's share), which grows with the parameters.
    for key in ("checkpoint_bytes", "save_s", "restore_s", "universal_s", "universal_peak_rss_gib"):
        if a[key] is None or b[key] is None:  # restore_s: only measured on one rank
            continue
        slope = (b[key] - a[key]) / (b["params"] - a["params"])
        out[key] = round(a[key] + slope * (target_params - a["params"]), 3)
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
    p.add_argument("--vocab", type=int, default=None,
                   help="a smaller vocabulary for the measured models (the fit still targets the full one)")
    p.add_argument("--zero-stage", type=int, default=2)
    p.add_argument("--world", type=int, default=1,
                   help="ranks that train and save the checkpoint (processes on this machine; GPUs with --gpu)")
    p.add_argument("--tokens", type=int, default=None, help="tokens in the timed step (default 4096 GPU, 256 CPU)")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file")
    p.add_argument("--universal-dir", default=None,
                   help="where the universal conversion writes (default: the temp folder of the checkpoint); "
                        "at 7B width it needs about twice the optimizer states' size")
    args = p.parse_args(argv)
    precision = args.precision or ("bf16" if args.gpu else "fp32")
    tokens = args.tokens or (4096 if args.gpu else 256)
    rows = []
    for n in args.layers or [None]:
        try:
            rows.append(measure(n, args.gpu, precision, args.zero_stage, tokens, args.tied, args.universal_dir, args.vocab,
                                args.world))
        except Exception as e:  # noqa: BLE001 - one depth that cannot run (memory, disk) must not lose the others
            rows.append({"layers": n, "error": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # kept if a later, larger depth gets killed
    measured = [r for r in rows if "error" not in r]
    if len(measured) >= 2:
        rows.append(extrapolate(measured, args.target_layers, shape_params(_shape(args.target_layers, args.tied, None))))
    from benchmarks.throughput import print_json_lines

    print_json_lines(rows, args.out)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
