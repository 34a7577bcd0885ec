"""Benchmark the data preprocessing: Ray Data (``hymt prepare``) vs ``datasets.Dataset.map(batched=True)``.

Both run the same steps with the same functions and tokenizer on the bundled Tatoeba sample scaled by
repetition: read → clean (NFC, languages, filters) → exact dedup → validation split → prompts + chat
template + tokenize → seeded order → pack → Parquet. Each copy of the corpus gets a marker (`` #k``) on
both sides so dedup does not simply remove the repetitions. Every (system, scale) runs in a fresh
subprocess; a separate sampling process reads memory at 10 Hz: the resident set size (RSS) summed over
the process tree (driver, GCS, raylet, Ray workers, datasets' worker processes) plus the object store's
use (Ray's own plasma statistics). Summed RSS counts pages shared by several processes (libraries,
object-store pages a worker has mapped) once per process, so it overstates the total: an upper bound.

    python jobs/bench_data.py --scales 1 10 100          # prints a Markdown table
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

# Under `ray job submit` the working dir is the repo but the package may not be installed there.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raytrain_hymt.sample import SAMPLE_CORPUS  # noqa: E402


def scaled_corpus(scale: int, folder: Path) -> Path:
    """The sample corpus repeated ``scale`` times, each copy's texts made distinct with `` #k``."""
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()
    out = folder / f"corpus-x{scale}.tsv"
    with open(out, "w", encoding="utf-8") as f:
        for k in range(scale):
            for line in lines:
                sl, tl, s, t = line.split("\t")
                f.write(f"{sl}\t{tl}\t{s} #{k}\t{t} #{k}\n" if k else line + "\n")
    return out


def _store_bytes(ray_address: str | None) -> int:
    if not ray_address:
        return 0
    from ray._private.internal_api import memory_summary

    m = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(address=ray_address, stats_only=True))
    return int(m.group(1)) << 20 if m else 0


def _tree_rss(root: int, skip: int) -> int:
    total = 0
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for p in procs:
        if p.pid != skip:
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return total


def _monitor(root: int, ray_address: str | None, stop, conn) -> None:
    """Runs in its own process (a sampling thread in the driver would compete with Ray Data's
    scheduling for the GIL): peak of summed RSS + object-store use, every 0.1 s."""
    peak = peak_store = 0
    while not stop.wait(0.1):
        store = _store_bytes(ray_address)
        peak_store = max(peak_store, store)
        peak = max(peak, _tree_rss(root, os.getpid()) + store)
    conn.send((peak, peak_store))


class MemorySampler:
    """Peak of (summed RSS of this process tree + Ray object store use), sampled at 10 Hz by a
    separate process."""

    def __init__(self, ray_address: str | None = None):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.idle = _tree_rss(os.getpid(), -1) + _store_bytes(ray_address)
        self._stop_event, (self._recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_monitor, args=(os.getpid(), ray_address, self._stop_event, send), daemon=True)
        self._proc.start()

    def stop(self) -> tuple[int, int]:
        """``(peak bytes, peak object-store bytes)``."""
        self._stop_event.set()
        peak = self._recv.recv()
        self._proc.join()
        return peak


def _config(path: Path, actors: int):
    from raytrain_hymt.config import SourceConfig, load_config

    cfg = load_config(None, [f"data.tokenize_actors={actors}"])
    cfg.data.sources = [SourceConfig(path=str(path), format="tatoeba")]
    return cfg


def run_ray(path: Path, out: Path, actors: int) -> dict:
    """``prepare_dataset`` on a fresh local Ray: seconds, counts, peak memory."""
    import ray

    from raytrain_hymt.data.prepare import prepare_dataset
    from raytrain_hymt.quiet import quiet_ray

    quiet_ray()
    ray.init(address="local", num_cpus=max(4, actors + 2), include_dashboard=False)
    sampler = MemorySampler(ray.get_runtime_context().gcs_address)
    t0 = time.perf_counter()
    stats = prepare_dataset(_config(path, actors), str(out))
    seconds = time.perf_counter() - t0
    peak, peak_store = sampler.stop()
    ray.shutdown()
    return {"seconds": seconds, "pairs": stats.rows_read, "train_examples": stats.train_examples,
            "train_tokens": stats.train_tokens, "peak_bytes": peak, "idle_bytes": sampler.idle,
            "peak_store_bytes": peak_store}


def _np(fn, **kwargs):
    """A pipeline batch function (numpy columns in and out) as a ``datasets`` batched map function."""

    def apply(batch):
        arrays = {k: np.asarray(v, dtype=object if v and isinstance(v[0], (str, list, np.ndarray)) else None)
                  for k, v in batch.items()}
        return {k: list(v) for k, v in fn(arrays, **kwargs).items()}

    return apply


def run_datasets(path: Path, out: Path, num_proc: int) -> dict:
    """The same steps with ``datasets.Dataset.map(batched=True)`` in this process (+ ``num_proc``)."""
    import datasets

    from raytrain_hymt.data.cleaning import clean_batch, pair_key
    from raytrain_hymt.data.packing import pack_examples
    from raytrain_hymt.data.pipeline import _add_directions, _mark_split, cleaning_rules
    from raytrain_hymt.data.readers import example_id
    from raytrain_hymt.data.tokenize import TokenizePairs

    datasets.disable_caching()
    datasets.disable_progress_bars()
    cfg = _config(path, 1)
    data = cfg.data
    sampler = MemorySampler()
    t0 = time.perf_counter()
    ds = datasets.load_dataset("csv", data_files=str(path), delimiter="\t", quoting=csv.QUOTE_NONE, split="train",
                               column_names=["src_lang", "tgt_lang", "src", "tgt"], keep_default_na=False,
                               cache_dir=str(out / "cache"))

    def ids(batch, idx):
        origins = [f"{path}:{i + 1}" for i in idx]
        return {"origin": origins, "example_id": [example_id(0, o) for o in origins],
                "source": [0] * len(idx), "drop_reason": [""] * len(idx), "copy": [0] * len(idx)}

    ds = ds.map(ids, batched=True, with_indices=True)
    ds = ds.map(lambda b: clean_batch(b, cleaning_rules(data)), batched=True, num_proc=num_proc)
    ds = ds.map(lambda b: {"pair_key": ["" if r else pair_key(s, t, a, c) for s, t, a, c, r in
                                        zip(b["src"], b["tgt"], b["src_lang"], b["tgt_lang"], b["drop_reason"])]},
                batched=True, num_proc=num_proc)
    seen: set[str] = set()

    def mark_dups(batch):  # one process: the set of keys seen so far must be shared
        reasons = []
        for key, reason in zip(batch["pair_key"], batch["drop_reason"]):
            reasons.append("duplicate" if key and key in seen else reason)
            seen.add(key)
        return {"drop_reason": reasons}

    ds = ds.map(mark_dups, batched=True, remove_columns=["pair_key"])
    ds = ds.map(_np(_mark_split, seed=data.seed, val_fraction=data.val_fraction), batched=True, num_proc=num_proc)
    ds = ds.map(_np(_add_directions, both=data.both_directions, seed=data.seed), batched=True, num_proc=num_proc)
    tokenizer = TokenizePairs(cfg.model.name_or_path, data.max_example_tokens)
    ds = ds.map(_np(tokenizer), batched=True, batch_size=data.tokenize_batch_size, num_proc=num_proc)
    reasons = Counter(ds["drop_reason"])
    keep = ["input_ids", "labels", "example_id", "order_key", "num_tokens"]
    for split, is_val in (("train", False), ("val", True)):
        part = ds.filter(lambda b: [r == "" and v == is_val for r, v in zip(b["drop_reason"], b["is_val"])],
                         batched=True, num_proc=num_proc).select_columns(keep).sort("order_key")
        if is_val:
            part = part.select(range(min(len(part), data.max_val_examples)))
        else:
            n_train, train_tokens = len(part), int(np.sum(part["num_tokens"]))
        rows = part.map(_np(pack_examples, max_tokens=data.pack_tokens), batched=True, batch_size=4096,
                        remove_columns=keep)
        rows.to_parquet(str(out / f"{split}.parquet"))
    seconds = time.perf_counter() - t0
    peak, _ = sampler.stop()
    return {"seconds": seconds, "pairs": sum(reasons.values()), "train_examples": n_train,
            "train_tokens": train_tokens, "peak_bytes": peak, "idle_bytes": sampler.idle, "peak_store_bytes": 0}


def one(system: str, scale: int, workers: int) -> dict:
    """One measurement in this process (called in a fresh subprocess by :func:`main`)."""
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        folder = Path(tmp)
        path = scaled_corpus(scale, folder)
        out = folder / "out"
        out.mkdir()
        result = run_ray(path, out, workers) if system == "ray" else run_datasets(path, out, workers)
    return {"system": system, "scale": scale, "workers": workers, **result}


def table(results: list[dict]) -> str:
    """The Markdown table of the README."""
    lines = ["| system | scale | pairs | seconds | pairs/s | train tokens/s | peak memory (MiB) | of which object store | peak above idle (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = "Ray Data (hymt prepare)" if r["system"] == "ray" else "datasets.map(batched=True)"
        lines.append(
            f"| {name}, {r['workers']} proc | {r['scale']}× | {r['pairs']:,} | {r['seconds']:.1f} | "
            f"{r['pairs'] / r['seconds']:,.0f} | {r['train_tokens'] / r['seconds']:,.0f} | {r['peak_bytes'] / 2**20:,.0f} | "
            f"{r['peak_store_bytes'] / 2**20:,.0f} | {(r['peak_bytes'] - r['idle_bytes']) / 2**20:,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--systems", nargs="+", default=["ray", "datasets"], choices=["ray", "datasets"])
    parser.add_argument("--workers", type=int, default=2, help="tokenizer actors (Ray) / num_proc (datasets)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement; the fastest is reported")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--one", nargs=2, metavar=("SYSTEM", "SCALE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), args.workers)), flush=True)
        return
    results = []
    for scale in args.scales:
        for system in args.systems:
            runs = []
            for _ in range(args.repeat):
                env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
                cmd = [sys.executable, __file__, "--one", system, str(scale), "--workers", str(args.workers)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode or not found:
                    sys.exit(f"{system} at {scale}× failed:\n{proc.stderr[-3000:]}")
                runs.append(json.loads(found[0][7:]))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
            results.append(min(runs, key=lambda r: r["seconds"]))  # others share this machine: best of N
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
