"""Host memory of loading a pretrained model into ZeRO-3 workers: whole (what training does; DeepSpeed
partitions it in ``deepspeed.initialize``) against partitioned while loading (``deepspeed.zero.Init``
through transformers' ``HfDeepSpeedConfig``, the usual advice against host OOM at load).

A random-init model of the Hunyuan-MT-7B shape (or the tiny one) is saved once as a model folder; then
``world`` processes, one per GPU (or CPU with gloo), load it each way and build the ZeRO-3 engine. Each
process reports its peak private (anonymous) memory while loading and while building the engine, its peak
resident memory (which also counts the memory-mapped weight files), and the GPU memory it holds. Run by
``jobs/bench_zero3_load.py``.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path
from typing import NoReturn

import torch

from benchmarks.ports import free_port
from benchmarks.rank_exit import end_rank


def save_model_folder(folder: Path, layers: int | None, gpu: bool) -> int:
    """Write a random-init model folder (``layers`` of the 7B shape, untied like Hunyuan-MT-7B; None: the
    tiny model) in bf16; returns its parameter count."""
    from raytrain_hymt.train.model import hunyuan_7b_config, load_model
    from raytrain_hymt.tokenizer import RANDOM_PREFIX, load_tokenizer

    tokenizer = load_tokenizer("tiny")
    if layers is None:
        model = load_model("tiny", tokenizer, dtype=torch.bfloat16)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "config.json"
            config.write_text(json.dumps(hunyuan_7b_config(layers, tie_word_embeddings=False)))
            model = load_model(f"{RANDOM_PREFIX}{config}", tokenizer, dtype=torch.bfloat16,
                               device="cuda" if gpu else "cpu")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kilobytes on Linux


class _AnonPeak:
    """Peak anonymous (private) resident memory, sampled every 20 ms from /proc/self/status.

    Peak RSS alone misleads here: safetensors files are memory-mapped, and their pages count in RSS though
    they are the page cache, shared by every process that reads the file and reclaimable. Private memory
    is what runs a node out of RAM."""

    def __init__(self):
        import threading

        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def current_kib() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, self.current_kib())
            self._stop.wait(0.02)

    def take(self) -> float:
        """The peak so far in GiB (and restart the window)."""
        peak = max(self.peak_kib, self.current_kib()) / 2**20
        self.peak_kib = 0
        return round(peak, 2)


def _rank(rank: int, world: int, port: int, folder: str, partitioned: bool, gpu: bool, out: str) -> NoReturn:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if not gpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.train.engine import build_ds_config, initialize_engine
    from raytrain_hymt.train.model import load_model
    from raytrain_hymt.tokenizer import load_tokenizer

    cfg = load_config(None, ["deepspeed.zero_stage=3", "deepspeed.precision=bf16", f"model.name_or_path={folder}",
                             f"scaling.num_workers={world}", f"scaling.use_gpu={str(gpu).lower()}"])
    tokenizer = load_tokenizer(folder)
    anon = _AnonPeak()
    anon.take()  # the window starts here: torch, CUDA and DeepSpeed imports are the same either way
    started = time.perf_counter()
    zero3 = None
    if partitioned:
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        deepspeed.init_distributed()  # zero.Init takes the world size from DeepSpeed's communicator
        zero3 = HfDeepSpeedConfig(build_ds_config(cfg, world, gpu))  # alive while loading: transformers' switch
    model = load_model(folder, tokenizer, dtype=torch.bfloat16)
    del zero3
    # What the comparison rests on: zero.Init really left each rank only its partitions.
    loaded_partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
    load_s = time.perf_counter() - started
    after_load, anon_load = _peak_rss_gib(), anon.take()
    initialize_engine(model, cfg, world, 10, on_gpu=gpu)
    row = {"rank": rank, "world": world, "partitioned_load": partitioned, "loaded_partitioned": loaded_partitioned,
           "load_s": round(load_s, 2),
           "peak_private_gib_load": anon_load, "peak_private_gib_engine": anon.take(),
           "peak_rss_gib_after_load": round(after_load, 2), "peak_rss_gib_after_engine": round(_peak_rss_gib(), 2),
           "gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    dist.barrier()
    end_rank()


def measure(layers: int | None, world: int, gpu: bool, workdir: str | None = None) -> list[dict]:
    """One row per rank and way of loading: peak host memory (GiB) after loading and after the engine."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="hymt-bench-load-", dir=workdir) as tmp:
        folder = Path(tmp) / "model"
        params = save_model_folder(folder, layers, gpu)
        rows: list[dict] = []
        for partitioned in (False, True):
            out = Path(tmp) / f"rows-{partitioned}.jsonl"
            # A fresh process per rank and mode: peak RSS is per process, so nothing carries over.
            mp.start_processes(_rank, args=(world, free_port(), str(folder), partitioned, gpu, str(out)),
                               nprocs=world, join=True, start_method="spawn")
            rows += [dict(json.loads(line), params=params, layers=layers) for line in out.read_text().splitlines()]
        return rows
