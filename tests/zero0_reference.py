"""The fp32 ZeRO-0 reference of tests/test_equivalence.py: plain data parallel, with the exact gradient
norm the ZeRO stages report. Test-only: the product never patches DeepSpeed.

At stage 0 DeepSpeed clips with a function that drops the norm it computed (``get_global_grad_norm()``
stays None), and that norm sums in fp32 per tensor: on CPU it was off by ~1e-4 relative for the tiny
model's output head. ``record_exact_grad_norm`` clips the same way (scale by ``max / (norm + 1e-6)``
when above ``max``) with the norm summed in fp64, and keeps it where ``get_global_grad_norm()`` reads
it. Gradients are already averaged over ranks there, so every rank computes the same norm.
"""

from __future__ import annotations


def record_exact_grad_norm(engine) -> None:
    """Replace a stage-0 ``engine``'s gradient clipping by the exact one above."""
    import torch

    def clip_and_record():
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        norm = float(torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum().sqrt())
        coef = min(1.0, engine.gradient_clipping() / (norm + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
        engine._global_grad_norm = norm

    engine.clip_fp32_gradients = clip_and_record
