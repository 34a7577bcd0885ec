"""A preset run the way users run it, from a model folder, with the figures the README quotes.

    python3 jobs/bench_real_model.py --preset hy-mt-7b-lora --model-dir /dev/shm/hymt-8b --untied --steps 20

Writes a random-init model folder of the Hunyuan-7B shape once (``--model-dir``; /dev/shm on GPU machines),
starts its own ``ray start --head`` (stopped by process group, never a bare ``ray stop``) so that the driver
joins a cluster and its peak RSS is its own, then runs ``hymt train --config PRESET`` with only the model
folder, the worker count, the step count and tracking changed. Reports one JSON line: the GPU memory peaks
(``max_memory_allocated``/``max_memory_reserved``), tokens/s per GPU, the checkpoint's size against the
base's safetensors, the workers' export time and the driver's peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
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


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="hy-mt-7b-lora")
    p.add_argument("--model-dir", required=True, help="model folder (written first if missing)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--untied", action="store_true", help="untied embeddings (8.03 B, Hunyuan-MT-7B's own)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--out", default="real_model_out")
    p.add_argument("--set", dest="extra", action="append", default=[])
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from benchmarks.throughput import SAFE_GPU_ENV, model_folder

    os.environ.update({k: v for k, v in SAFE_GPU_ENV.items() if k not in os.environ})
    gpu = torch.cuda.is_available()
    t0 = time.time()
    folder = model_folder("7b", args.layers, not args.untied, out, gpu, args.model_dir)
    write_s = time.time() - t0
    torch.cuda.empty_cache()
    name = f"real-{args.preset}-{int(time.time())}"
    cmd = [sys.executable, "-m", "raytrain_hymt.cli", "train", "--config", args.preset, "--name", name,
           *[a for o in [f"model.name_or_path={folder}", f"scaling.num_workers={args.workers}",
                         f"optim.max_steps={args.steps}", "tracking.enabled=false",
                         f"run.storage_root={out / 'runs'}", *args.extra] for a in ("--set", o)]]
    with _own_ray(torch.cuda.device_count() if gpu else 0, os.cpu_count() or 2) as address:
        env = dict(os.environ, RAY_ADDRESS=address)
        log_path = out / f"{name}.log"
        started = time.time()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines: list[str] = []

            def pump():
                for line in proc.stdout:
                    lines.append(line)
                    log.write(line)
                    print(line, end="", flush=True)

            reader = threading.Thread(target=pump)
            reader.start()
            driver_peak = peak_rss_until_exit(proc)
            reader.join()
        wall = time.time() - started
    text = "".join(lines)
    run = out / "runs" / name
    ckpts = sorted(run.glob("checkpoint_step*"))
    result = {"preset": args.preset, "layers": args.layers, "untied": args.untied, "steps": args.steps,
              "exit_code": proc.returncode, "wall_s": wall, "model_write_s": write_s,
              "driver_peak_rss_gib": driver_peak / 2**30,
              "base_safetensors_bytes": sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))}
    if ckpts:
        result["checkpoint_bytes"] = _size(ckpts[-1])
        result["checkpoint_fraction_of_base"] = result["checkpoint_bytes"] / result["base_safetensors_bytes"]
    if (run / "model").exists():
        result["export_bytes"] = _size(run / "model")
    memory = re.findall(r"GPU memory peak ([\d.]+) GiB allocated, ([\d.]+) reserved", text)
    if memory:
        result["max_memory_allocated_gib"], result["max_memory_reserved_gib"] = map(float, memory[-1])
    rates = [float(x) for x in re.findall(r" (\d+) tok/s/worker", text)]
    if len(rates) > 2:
        result["tokens_per_s_per_gpu_last"] = rates[-1]
    exported = re.findall(r"exported the model to \S+ in (\d+) s", text)
    if exported:
        result["export_s"] = float(exported[-1])
    print(json.dumps(result), flush=True)
    with open(out / "real_model.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    return 0 if result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
