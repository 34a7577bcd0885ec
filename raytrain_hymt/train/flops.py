"""Throughput accounting (pure): honest FLOPs per step and MFU, real tokens only.

FLOPs of a step = 6·N·tokens + 12·L·H·Q·Σ T_doc², where N counts every parameter that takes part in a
matmul once (the input embedding only when it is tied to the output head), L layers, H attention heads,
Q head dim, T_doc each document's own length (a packed row's documents never attend to each other, so
the pack length would overstate attention). Padding tokens are never counted.

6·N is 2·N forward + 2·N for the activations' gradients + 2·N for the weights' gradients. Frozen weights
(LoRA's base model) get no weight gradients, so with T trainable matmul parameters it is (4·N + 2·T).
"""

from __future__ import annotations

from collections.abc import Iterable

# Dense bf16 peak by the datasheet; MFU is quoted against it (an H100/H200 measures ~790 in bf16 matmuls).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def _numel(p) -> int:
    # ZeRO-3 replaces parameters by empty placeholders; ds_numel keeps the real size.
    return getattr(p, "ds_numel", 0) or p.numel()


def matmul_params(model, trainable_only: bool = False) -> int:
    """N: parameters used in matmuls, each counted once (input embedding excluded when untied);
    ``trainable_only``: only those that get weight gradients (T; LoRA: the adapters)."""
    # parameters() yields a shared (tied) tensor once.
    total = sum(_numel(p) for p in model.parameters() if p.requires_grad or not trainable_only)
    embedding = model.get_input_embeddings().weight
    if not getattr(model.config, "tie_word_embeddings", False) and (embedding.requires_grad or not trainable_only):
        total -= _numel(embedding)
    return total


def step_flops(n_params: int, layers: int, heads: int, head_dim: int, doc_lengths: Iterable[int],
               trainable_params: int | None = None) -> float:
    """Training FLOPs (forward + backward) of the documents in one step; ``trainable_params`` (T, default
    N: full fine-tuning) sets how many weights get gradients."""
    lengths = list(doc_lengths)
    tokens = sum(lengths)
    t = n_params if trainable_params is None else trainable_params
    return (4.0 * n_params + 2.0 * t) * tokens + 12.0 * layers * heads * head_dim * sum(x * x for x in lengths)


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
