"""Benchmark the data preprocessing: Ray Data (``hymt prepare``) vs ``datasets.Dataset.map(batched=True)``.

Both run the same steps with the same functions and tokenizer on the bundled Tatoeba sample scaled by
repetition: read → clean (NFC, languages, filters) → exact dedup → validation split → prompts + chat
template + tokenize → seeded order → pack → Parquet. Each copy of the corpus gets a marker (`` #k``) on
both sides so dedup does not simply remove the repetitions. Every (system, scale) runs in a fresh
subprocess; a separate sampling process reads memory at 10 Hz: the resident set size (RSS) summed over
the process tree (driver, GCS, raylet, Ray workers, datasets' worker processes) plus the object store's
use (Ray's own plasma statistics). Summed RSS counts pages shared by several processes (libraries,
object-store pages a worker has mapped) once per process, so it overstates the total: an upper bound.

    nice -n 19 python jobs/bench_data.py --scales 1 100 1000 --json bench.json   # prints a Markdown table

Each system also runs once on :data:`STARTUP_PAIRS` pairs first: its fixed start-up cost, reported on
its own line and subtracted in the "pairs/s beyond start-up" column.

Ray also reports the largest block of tokenized examples (one sort partition, what one task holds) and,
in a fresh Ray after ``prepare``, the object store's peak while one reader streams every prepared
training row in the training loop's windows (``data.prepared_path``: not materialized). A run that
leaves the machine less than ``--reserve-gib`` of available memory is stopped and recorded as out of
memory (the machine is shared: it must not push other processes into the OOM killer); one that exceeds
``--timeout`` is recorded as such.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa

# Under `ray job submit` the working dir is the repo but the package may not be installed there.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from raytrain_hymt.data.files import SAMPLE_CORPUS  # noqa: E402


#: Pairs of the start-up measurement (scale 0): enough to run every stage, too few to take time.
STARTUP_PAIRS = 100
#: Prepared training rows streamed to measure the object store while training reads them (~12 windows).
STREAM_ROWS = 100_000


def scaled_corpus(scale: int, folder: Path) -> Path:
    """The sample corpus repeated ``scale`` times, each copy's texts made distinct with `` #k``; scale 0:
    its first :data:`STARTUP_PAIRS` lines (the fixed start-up cost of a system)."""
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()
    if scale == 0:
        lines, scale = lines[:STARTUP_PAIRS], 1
    out = folder / f"corpus-x{scale}.tsv"
    with open(out, "w", encoding="utf-8") as f:
        for k in range(scale):
            for line in lines:
                sl, tl, s, t = line.split("\t")
                f.write(f"{sl}\t{tl}\t{s} #{k}\t{t} #{k}\n" if k else line + "\n")
    return out


def _plasma_file(root: int) -> str | None:
    """``/proc/<raylet>/map_files/<range>`` of the object store's shared-memory file of the local Ray
    started under ``root`` (None without Ray)."""
    for p in psutil.Process(root).children(recursive=True):
        if p.name() == "raylet":
            for line in open(f"/proc/{p.pid}/maps"):
                if "/dev/shm/plasma" in line:
                    return f"/proc/{p.pid}/map_files/{line.split()[0]}"
    return None


def _store_bytes(plasma_file: str | None) -> int:
    # The store's memory: the pages of its /dev/shm file in RAM (a stat, unlike Ray's memory summary,
    # an RPC to every worker that took a whole core at 10 Hz). Freed objects' pages stay until reused,
    # so this is the store's high-water mark.
    if not plasma_file:
        return 0
    try:
        return os.stat(plasma_file).st_blocks * 512
    except FileNotFoundError:  # Ray shut down
        return 0


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


def _monitor(root: int, plasma_file: str | None, stop, conn) -> None:
    """Runs in its own process (a sampling thread in the driver would compete with Ray Data's
    scheduling for the GIL): peak of summed RSS + object-store use, every 0.1 s."""
    peak = peak_store = 0
    while not stop.wait(0.1):
        store = _store_bytes(plasma_file)
        peak_store = max(peak_store, store)
        peak = max(peak, _tree_rss(root, os.getpid()) + store)
    conn.send((peak, peak_store))


class MemorySampler:
    """Peak of (summed RSS of this process tree + Ray object store use), sampled at 10 Hz by a
    separate process."""

    def __init__(self):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        plasma_file = _plasma_file(os.getpid())
        self.idle = _tree_rss(os.getpid(), -1) + _store_bytes(plasma_file)
        self._stop_event, (self._recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_monitor, args=(os.getpid(), plasma_file, self._stop_event, send), daemon=True)
        self._proc.start()

    def stop(self) -> tuple[int, int]:
        """``(peak bytes, peak object-store bytes)``."""
        self._stop_event.set()
        peak = self._recv.recv()
        self._proc.join()
        return peak


def _config(path: Path, actors: int):
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.config.schema import SourceConfig

    cfg = load_config(None, [f"data.tokenize_actors={actors}"])
    cfg.data.sources = [SourceConfig(path=str(path), format="tatoeba")]
    return cfg


def run_ray(path: Path, out: Path, actors: int) -> dict:
    """``prepare_dataset`` on a fresh local Ray: seconds, counts, peak memory."""
    import ray

    from raytrain_hymt.driver.train import prepare_dataset
    from raytrain_hymt.console.quiet import quiet_ray

    quiet_ray()
    ray.init(address="local", num_cpus=max(4, actors + 2), include_dashboard=False)
    sampler = MemorySampler()
    t0 = time.perf_counter()
    cfg = _config(path, actors)
    stats = prepare_dataset(cfg, str(out))
    seconds = time.perf_counter() - t0
    peak, peak_store = sampler.stop()
    ray.shutdown()
    return {"seconds": seconds, "pairs": stats.rows_read, "train_examples": stats.train_examples,
            "train_tokens": stats.train_tokens, "peak_bytes": peak, "idle_bytes": sampler.idle,
            "peak_store_bytes": peak_store, "largest_block_bytes": stats.largest_block_bytes,
            **stream_prepared(cfg, out)}


def stream_prepared(cfg, out: Path) -> dict:
    """Read the prepared training rows (up to :data:`STREAM_ROWS`) as one training rank of one does
    (``data.prepared_path``, the loop's windows and lanes: every row), in a fresh Ray: the object store's
    peak, the rows, the Parquet bytes, the seconds."""
    import ray

    from raytrain_hymt.data.blocks import RowFetcher, train_blocks
    from raytrain_hymt.data.epochs import batches, window_rows
    from raytrain_hymt.data.pipeline import build_datasets

    ray.init(address="local", num_cpus=4, include_dashboard=False)
    sampler = MemorySampler()
    t0 = time.perf_counter()
    cfg.data.prepared_path = str(out)
    train, _, stats = build_datasets(cfg)
    fetch = RowFetcher(train_blocks(cfg, train))
    window = window_rows(cfg.data.epoch_shuffle_rows, 4)
    rows = 0
    one_epoch = itertools.islice(batches(fetch, stats.train_rows, window, 4, range(4), cfg.data.seed, 1, 0),
                                 stats.train_rows // 4)
    for _, _, batch in one_epoch:
        rows += len(batch["input_ids"])
        if rows >= STREAM_ROWS:  # steady state long reached: the store's peak does not grow with the rows
            break
    seconds = time.perf_counter() - t0
    _, peak_store = sampler.stop()
    ray.shutdown()
    parquet = sum(p.stat().st_size for p in out.rglob("*.parquet") if "/train/" in str(p))
    return {"stream_rows": rows, "stream_seconds": seconds, "stream_peak_store_bytes": peak_store,
            "prepared_train_bytes": parquet}


def _np(fn, **kwargs):
    """A pipeline batch function (numpy columns in; numpy columns or an Arrow table out) as a
    ``datasets`` batched map function."""

    def apply(batch):
        arrays = {k: np.asarray(v, dtype=object if v and isinstance(v[0], (str, list, np.ndarray)) else None)
                  for k, v in batch.items()}
        out = fn(arrays, **kwargs)
        return out if isinstance(out, pa.Table) else {k: list(v) for k, v in out.items()}

    return apply


def run_datasets(path: Path, out: Path, num_proc: int) -> dict:
    """The same steps with ``datasets.Dataset.map(batched=True)`` in this process (+ ``num_proc``)."""
    import datasets

    from raytrain_hymt.data.packing import pack_examples
    from raytrain_hymt.data.pipeline import cleaning_rules, order_key, prepare_pairs
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
        return {"origin": origins, "example_id": [example_id(0, f"{path.name}:{i + 1}") for i in idx],
                "source": [0] * len(idx), "drop_reason": [""] * len(idx)}

    ds = ds.map(ids, batched=True, with_indices=True)
    ds = ds.map(_np(prepare_pairs, rules=cleaning_rules(data), seed=data.seed, val_fraction=data.val_fraction,
                    both=data.both_directions), batched=True, num_proc=num_proc, remove_columns=ds.column_names)
    tokenizer = TokenizePairs(cfg.model.name_or_path, data.max_example_tokens)
    ds = ds.map(_np(tokenizer), batched=True, batch_size=data.tokenize_batch_size, num_proc=num_proc,
                remove_columns=ds.column_names)
    seen: set[str] = set()

    def mark_dups(batch):  # one process: the set of keys seen so far must be shared
        reasons = []
        for key, reason in zip(batch["pair_key"], batch["drop_reason"]):
            reasons.append("duplicate" if key and key in seen else reason)
            seen.add(key)
        return {"drop_reason": reasons}

    ds = ds.map(mark_dups, batched=True, remove_columns=["pair_key"])
    ds = ds.map(lambda b: {"order_key": order_key(b["example_id"], b["direction"], data.seed)}, batched=True,
                num_proc=num_proc)
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
    # Reversed pairs are rows too: count corpus rows (direction 0) only.
    pairs = sum(reasons.values()) - int(np.sum(ds["direction"]))
    return {"seconds": seconds, "pairs": pairs, "train_examples": n_train,
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


def _name(system: str) -> str:
    return "Ray Data (hymt prepare)" if system == "ray" else "datasets.map(batched=True)"


def table(results: list[dict], startup: dict[str, float]) -> str:
    """The Markdown table of the README. ``startup``: seconds of each system's :data:`STARTUP_PAIRS`-pair
    run, its fixed cost (Ray: worker processes, tokenizer actors, one execution per stage); "pairs/s
    beyond start-up" divides by the seconds above it, the rate a larger corpus approaches."""
    mib = 2**20
    lines = ["| system | scale | pairs | seconds | pairs/s | pairs/s beyond start-up | train tokens/s | peak memory (MiB) | "
             "of which object store | largest block (MiB) | object store peak streaming the prepared rows (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, seconds in startup.items():
        lines.append(f"| {_name(system)}: start-up | {STARTUP_PAIRS} pairs | {STARTUP_PAIRS} | {seconds:.1f} | | | | | | | |")
    for r in results:
        if r.get("failed"):
            lines.append(f"| {_name(r['system'])}, {r['workers']} proc | {r['scale']}× | {r['expected_pairs']:,} | "
                         f"{r['seconds']:.0f} | {r['failed']} | | | {r['peak_bytes'] / mib:,.0f} (when stopped) | | | |")
            continue
        beyond = r["seconds"] - startup.get(r["system"], 0.0)
        rate_beyond = f"{r['pairs'] / beyond:,.0f}" if beyond > 0 else ""  # a loaded machine's noise can exceed it
        ray_only = (f"{r['largest_block_bytes'] / mib:,.1f} | {r['stream_peak_store_bytes'] / mib:,.1f} of "
                    f"{r['prepared_train_bytes'] / mib:,.0f} Parquet" if r["system"] == "ray" else "| ")
        lines.append(
            f"| {_name(r['system'])}, {r['workers']} proc | {r['scale']}× | {r['pairs']:,} | {r['seconds']:.1f} | "
            f"{r['pairs'] / r['seconds']:,.0f} | {rate_beyond} | "
            f"{r['train_tokens'] / r['seconds']:,.0f} | "
            f"{r['peak_bytes'] / 2**20:,.0f} | {r['peak_store_bytes'] / 2**20:,.0f} | {ray_only} |"
        )
    return "\n".join(lines)


def ratios(results: list[dict]) -> str:
    """Per scale: Ray's end-to-end pairs/s and peak memory against ``datasets``'."""
    out = []
    for scale in sorted({r["scale"] for r in results} - {0}):
        ray = next((r for r in results if r["scale"] == scale and r["system"] == "ray"), None)
        base = next((r for r in results if r["scale"] == scale and r["system"] == "datasets"), None)
        if not ray or not base or ray.get("failed"):
            continue
        if base.get("failed"):
            out.append(f"- {scale}×: datasets {base['failed']}; Ray finished in {ray['seconds']:.0f} s, peak "
                       f"{ray['peak_bytes'] / 2**30:.1f} GiB")
            continue
        speed = (ray["pairs"] / ray["seconds"]) / (base["pairs"] / base["seconds"])
        out.append(f"- {scale}×: throughput {speed:.2f}× datasets', peak memory {ray['peak_bytes'] / base['peak_bytes']:.2f}× datasets'")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 100, 1000])
    parser.add_argument("--systems", nargs="+", default=["ray", "datasets"], choices=["ray", "datasets"])
    parser.add_argument("--workers", type=int, default=2, help="tokenizer actors (Ray) / num_proc (datasets)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement; the fastest is reported")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one measurement may take")
    parser.add_argument("--reserve-gib", type=float, default=2.0,
                        help="stop a run (recorded as out of memory) when the machine has less available")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole benchmark: no measurement starts after it, each is cut at it")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up measurement (100 pairs)")
    parser.add_argument("--json", default=None, help="also write the results here (rewritten after every run)")
    parser.add_argument("--one", nargs=2, metavar=("SYSTEM", "SCALE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), args.workers)), flush=True)
        return
    results = []
    end = time.monotonic() + (args.budget_s or float("inf"))
    for scale in ([] if args.no_startup else [0]) + args.scales:
        for system in args.systems:
            left = end - time.monotonic()
            if left <= 0:
                print(f"budget spent: {system} at {scale}× not run", file=sys.stderr)
                continue
            results.append(best(system, scale, args.workers, args.repeat, min(args.timeout, left), args.reserve_gib))
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    startup = {r["system"]: r["seconds"] for r in results if r["scale"] == 0}
    print(table([r for r in results if r["scale"] != 0], startup))
    print(ratios(results))


def _watch(cmd: list[str], env: dict, timeout: float, reserve_gib: float) -> tuple[subprocess.CompletedProcess | None, str, int]:
    """Run ``cmd`` in its own process group; stop it when it runs past ``timeout`` or the machine's
    available memory falls below ``reserve_gib``. ``(finished process or None, why stopped, peak summed
    RSS seen)``."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    import threading

    out: dict[str, str] = {}
    readers = [threading.Thread(target=lambda k, f: out.__setitem__(k, f.read()), args=(k, f), daemon=True)
               for k, f in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for t in readers:
        t.start()
    t0, peak, why = time.monotonic(), 0, ""
    while proc.poll() is None:
        time.sleep(0.2)
        peak = max(peak, _tree_rss(proc.pid, -1))
        if psutil.virtual_memory().available < reserve_gib * 2**30:
            why = f"out of memory (stopped at {peak / 2**30:.1f} GiB summed RSS, the machine below {reserve_gib:g} GiB free)"
        elif time.monotonic() - t0 > timeout:
            why = f"timed out after {timeout:.0f} s"
        if why:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for t in readers:
        t.join()
    if not why and proc.returncode == -signal.SIGKILL:
        why = "killed (out of memory: SIGKILL from the kernel)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out.get("stdout", ""), out.get("stderr", "")), why, peak


def best(system: str, scale: int, workers: int, repeat: int, timeout: float, reserve_gib: float) -> dict:
    """The fastest of ``repeat`` fresh-process runs (others share this machine); a run stopped for memory
    or time is the result, with the seconds it ran."""
    runs = []
    for _ in range(repeat):
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, __file__, "--one", system, str(scale), "--workers", str(workers)]
        t0 = time.perf_counter()
        proc, why, peak = _watch(cmd, env, timeout, reserve_gib)
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if why:
            runs.append({"system": system, "scale": scale, "workers": workers, "failed": why, "peak_bytes": peak,
                         "seconds": time.perf_counter() - t0, "expected_pairs": 10_390 * max(scale, 1)})
        elif proc.returncode or not found:
            sys.exit(f"{system} at {scale}× failed:\n{proc.stderr[-3000:]}")
        else:
            runs.append(json.loads(found[0][7:]))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    return min(runs, key=lambda r: r["seconds"])


if __name__ == "__main__":
    main()
