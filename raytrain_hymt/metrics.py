"""Throughput accounting (pure): honest FLOPs per step and MFU, as defined in FACTS.md.

FLOPs of a step = 6·N·tokens + 12·L·H·Q·Σ T_doc², where N counts every parameter that takes part in a
matmul once (the input embedding only when it is tied to the output head), L layers, H attention heads,
Q head dim, T_doc each document's own length (a packed row's documents never attend to each other, so
the pack length would overstate attention). Padding tokens are never counted.
"""

from __future__ import annotations

from collections.abc import Iterable

# Dense bf16 peak by the datasheet; MFU is quoted against it (FACTS.md also gives ~790 measured).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def _numel(p) -> int:
    # ZeRO-3 replaces parameters by empty placeholders; ds_numel keeps the real size.
    return getattr(p, "ds_numel", 0) or p.numel()


def matmul_params(model) -> int:
    """N: parameters used in matmuls, each counted once (input embedding excluded when untied)."""
    total = sum(_numel(p) for p in model.parameters())  # parameters() yields a shared tensor once
    if not getattr(model.config, "tie_word_embeddings", False):
        total -= _numel(model.get_input_embeddings().weight)
    return total


def step_flops(n_params: int, layers: int, heads: int, head_dim: int, doc_lengths: Iterable[int]) -> float:
    """Training FLOPs (forward + backward) of the documents in one step."""
    lengths = list(doc_lengths)
    tokens = sum(lengths)
    return 6.0 * n_params * tokens + 12.0 * layers * heads * head_dim * sum(t * t for t in lengths)


def peak_flops(device_name: str | None) -> float | None:
    """Datasheet bf16 peak FLOP/s of a GPU by name, or None (CPU, unknown card: no MFU)."""
    if not device_name:
        return None
    for key, tflops in PEAK_TFLOPS.items():
        if key in device_name:
            return tflops * 1e12
    return None


def mfu(flops: float, seconds: float, num_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation of a step, or None when the peak is unknown."""
    if peak is None or seconds <= 0:
        return None
    return flops / (seconds * num_devices * peak)
