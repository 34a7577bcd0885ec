"""A preset run the way users run it, from a model folder, with the figures the README quotes.

    python3 jobs/bench_real_model.py --preset hy-mt-7b-lora --model-dir /dev/shm/hymt-8b --untied --steps 20
    python3 jobs/bench_real_model.py --preset hy-mt-7b-lora-fast --shape tiny --cpu --steps 2 --model-dir /tmp/tiny

Writes a random-init model folder of the Hunyuan-7B shape once (``--model-dir``; /dev/shm on GPU machines;
``--shape tiny``: the tiny model, for CPU smoke runs with ``--cpu``), joins the cluster in ``RAY_ADDRESS`` or
starts its own ``ray start --head`` (stopped by process group, never a bare ``ray stop``) so that the driver
joins a cluster and its peak RSS is its own, then runs ``hymt train --config PRESET`` with only the model
folder, the worker count, the step count and the tracking store (an sqlite file under ``--out``; MLflow off where it is not installed)
changed.
Reports one JSON line, every figure from what the workers wrote (``benchmarks.run_figures``: rank 0's
``metrics.jsonl``, the checkpoint and model folders, ``summary.json``), none from the console: the GPU memory
peaks (``max_memory_allocated``/``max_memory_reserved``), tokens/s per GPU, MFU, the checkpoint's size against
the base's safetensors, the workers' export time, and the driver's peak RSS (read from /proc).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.ports import free_port  # noqa: E402


@contextlib.contextmanager
def _own_ray(num_gpus: int, num_cpus: int):
    temp = tempfile.mkdtemp(prefix="hymt-ray-", dir="/tmp")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", f"--num-gpus={num_gpus}", f"--num-cpus={num_cpus}", f"--temp-dir={temp}",
         "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(15)
        yield f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def peak_rss_until_exit(proc: subprocess.Popen, every_s: float = 0.1) -> int:
    """Peak resident bytes of ``proc`` itself (its own ``VmHWM``, read until it exits); waits for it.

    Not ``wait4``'s ``ru_maxrss``: Linux carries the parent's resident size at ``fork`` into the child's
    maximum, so a parent holding a model folder's weights would be charged to the driver."""
    peak = 0
    while proc.poll() is None:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) * 1024)
        time.sleep(every_s)
    return peak


@contextlib.contextmanager
def _cluster(num_gpus: int, num_cpus: int):
    """The cluster in ``RAY_ADDRESS`` when set, else a Ray of this benchmark's own."""
    if os.environ.get("RAY_ADDRESS"):
        yield os.environ["RAY_ADDRESS"]
        return
    with _own_ray(num_gpus, num_cpus) as address:
        yield address


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="hy-mt-7b-lora")
    p.add_argument("--model-dir", required=True, help="model folder (written first if missing)")
    p.add_argument("--shape", default="7b", choices=["7b", "tiny"], help="model shape (tiny: CPU smoke runs)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--untied", action="store_true", help="untied embeddings (8.03 B, Hunyuan-MT-7B's own)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--cpu", action="store_true", help="CPU workers with gloo, the preset's GPU-only levers off")
    p.add_argument("--out", default="real_model_out")
    p.add_argument("--set", dest="extra", action="append", default=[])
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from benchmarks.run_figures import run_figures
    from benchmarks.throughput import CPU_PRESET_OVERRIDES, SAFE_GPU_ENV, model_folder

    os.environ.update({k: v for k, v in SAFE_GPU_ENV.items() if k not in os.environ})
    gpu = torch.cuda.is_available() and not args.cpu
    t0 = time.time()
    folder = model_folder(args.shape, args.layers, not args.untied, out, gpu, args.model_dir)
    write_s = time.time() - t0
    torch.cuda.empty_cache()
    name = f"real-{args.preset}-{int(time.time())}"
    # The figures come from rank 0's metrics.jsonl, which is written with MLflow on or off: a GPU image
    # without MLflow still benchmarks, and one with it records the run in an sqlite store beside the results.
    tracking = (["tracking.enabled=true", f"tracking.tracking_uri=sqlite:///{out / 'mlflow.db'}"]
                if importlib.util.find_spec("mlflow") else ["tracking.enabled=false"])
    cmd = [sys.executable, "-m", "raytrain_hymt.cli", "train", "--config", args.preset, "--name", name,
           *[a for o in [f"model.name_or_path={folder}", f"scaling.num_workers={args.workers}",
                         f"optim.max_steps={args.steps}", *tracking, f"run.storage_root={out / 'runs'}",
                         *(CPU_PRESET_OVERRIDES if args.cpu else []), *args.extra] for a in ("--set", o)]]
    with _cluster(torch.cuda.device_count() if gpu else 0, os.cpu_count() or 2) as address:
        env = dict(os.environ, RAY_ADDRESS=address)
        log_path = out / f"{name}.log"
        started = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

            def pump():  # the console is for the user to watch; no figure is read from it
                for line in proc.stdout:
                    log.write(line)
                    print(line, end="", flush=True)

            reader = threading.Thread(target=pump)
            reader.start()
            driver_peak = peak_rss_until_exit(proc)
            reader.join()
        wall = time.time() - started
    base_bytes = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
    result = {"preset": args.preset, "shape": args.shape, "layers": args.layers, "untied": args.untied,
              "steps": args.steps, "workers": args.workers,
              "device": torch.cuda.get_device_name(0) if gpu else "cpu",
              "exit_code": proc.returncode, "wall_s": wall, "model_write_s": write_s,
              "driver_peak_rss_gib": driver_peak / 2**30, "base_safetensors_bytes": base_bytes,
              **run_figures(out / "runs", name)}
    result["checkpoint_fraction_of_base"] = (result["checkpoint_bytes"] / base_bytes
                                             if result["checkpoint_bytes"] is not None else None)
    print(json.dumps(result), flush=True)
    with open(out / "real_model.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    if result["exit_code"] == 0 and not result["steps_logged"]:
        print(f"the run logged no step metrics to {out / 'runs' / name}: its figures are missing", file=sys.stderr)
        return 1
    return 0 if result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
