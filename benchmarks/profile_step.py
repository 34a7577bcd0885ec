"""Where one training step's GPU time goes: the step run under ``torch.profiler``, its kernels summed by
kind (matrix multiplies, attention, compiled fusions, the optimizer, communication, copies, the rest)
against the step's wall time, so that each speed lever's ceiling is a measured share of the step.
"""

from __future__ import annotations

import time

#: Kernel kinds, first match wins, by substrings of the lower-cased kernel name.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("attention (flex templates)", ("flex", "triton_tem")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_", "sm100_")),
    ("compiled fusions (inductor triton)", ("triton_",)),
    ("liger / other triton", ("_kernel",)),
    ("copies and fills", ("memcpy", "memset", "copy_kernel", "fill_kernel")),
)


def kind_of(name: str) -> str:
    """The kind of kernel ``name`` (see :data:`KINDS`); ``other (eager)`` when none matches."""
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other (eager)"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of ``(start, end)`` intervals (kernels on several streams overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize_kernels(kernels: list[tuple[str, float, float]], wall_s: float, top: int = 15) -> dict:
    """Summary of ``(name, start_us, end_us)`` kernels of a step of ``wall_s`` seconds: GPU busy share,
    time per kind (ms and share of the wall time) and the ``top`` kernels by time."""
    wall_ms = 1000 * wall_s
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for name, start, end in kernels:
        ms = (end - start) / 1000
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += ms
        entry[1] += 1
    busy_ms = busy_us([(s, e) for _, s, e in kernels]) / 1000
    return {
        "wall_ms": wall_ms, "gpu_busy_ms": busy_ms, "gpu_idle_share": 1 - busy_ms / wall_ms if wall_ms else None,
        "kernels": len(kernels),
        "by_kind_ms": {k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "by_kind_share_of_wall": {k: round(v / wall_ms, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "ms": round(v[0], 3), "calls": v[1], "kind": kind_of(n)}
                        for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def profile_call(fn, *args):
    """``fn(*args)`` under ``torch.profiler`` (CPU and CUDA activities): ``(its result, summary)``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = fn(*args)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    return result, summarize_kernels(kernels, wall)
