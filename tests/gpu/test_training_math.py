"""The GPU training math on a full-width Hunyuan-7B shape (2 layers, bf16), each against an independent
reference: flex attention's document mask against each document run alone through SDPA; Liger's fused
loss against the plain token-loss sum; compiled layers against eager ones; ZeRO-3 against ZeRO-2; fp16's
loss scaling skipping an overflowing step. This process stands in for the one Ray Train worker of a world
of 1 (gpu_models.py says why that is enough here).

bf16 tolerances: bf16 keeps 8 significant bits (a rounding of up to 2^-9 ≈ 0.2% per value), and the
compared paths run different kernels with different summation orders (flex's Triton kernel vs SDPA's,
Liger's chunked fp32 head vs a bf16 logits tensor, inductor's fused layers vs eager ones), so results
agree to about a percent (flex vs SDPA logits: 0.96% seen on an H100) and gradients, which pass through more
roundings, to a few percent (1.9% seen).
A broken mask, loss or layer moves them by tens of percent or more.
"""

from __future__ import annotations

import math

import pytest

from gpu_models import skip_without_cuda

skip_without_cuda()

import torch  # noqa: E402

from gpu_models import build_worker, model_folder, packed_rows, rel_err, release  # noqa: E402

#: Relative bounds (‖a − b‖ / ‖b‖), see the module docstring.
LOGITS_TOL = 2e-2
LOSS_TOL = 5e-3
GRAD_TOL = 5e-2
#: Parameters whose gradients are compared: the attention of both layers (what the mask changes), an MLP,
#: the input embeddings and the untied output head (what the fused loss computes itself).
GRADS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
         "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight")


@pytest.mark.timeout(300)
def test_flex_document_mask_packed_rows_equal_each_document_alone():
    from raytrain_hymt.data.packing import collate, token_loss_sum
    from raytrain_hymt.tokenizer import load_tokenizer
    from raytrain_hymt.train.model import load_model

    folder = model_folder()
    tok = load_tokenizer(folder)
    model = load_model(folder, tok, dtype=torch.bfloat16, attn_implementation="flex_attention").cuda().train()
    row = packed_rows(1, 512)
    m = collate(row, pad_token_id=tok.pad_token_id, attn_implementation="flex_attention", pad_to=512,
                mask_dtype=torch.bfloat16, device="cuda")
    lens = [int(n) for n in row["seq_lens"][0]]
    assert len(lens) >= 4  # several documents share the row
    logits = model(input_ids=m["input_ids"], position_ids=m["position_ids"], attention_mask=m["attention_mask"],
                   use_cache=False).logits
    token_loss_sum(logits, m["labels"])[0].backward()
    params = dict(model.named_parameters())
    packed_grads = {n: params[n].grad.float().clone() for n in GRADS}
    model.zero_grad(set_to_none=True)

    # The reference: every document alone, through SDPA's plain causal attention (no document mask at all).
    model.set_attn_implementation("sdpa")
    start, errors = 0, []
    for n in lens:
        ids = m["input_ids"][:, start:start + n]
        alone = model(input_ids=ids, position_ids=torch.arange(n, device="cuda")[None], use_cache=False).logits
        errors.append(rel_err(logits[:, start:start + n].detach(), alone.detach()))
        token_loss_sum(alone, m["labels"][:, start:start + n])[0].backward()  # accumulates over documents
        start += n
    grad_errors = {n: rel_err(packed_grads[n], params[n].grad.float()) for n in GRADS}
    print(f"flex vs alone: logits rel err max {max(errors):.2e}; grads {grad_errors}")
    assert max(errors) < LOGITS_TOL, errors
    assert max(grad_errors.values()) < GRAD_TOL, grad_errors


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_fused_loss_equals_the_token_loss_sum(stage, tmp_path):
    from deepspeed.utils import safe_get_full_grad

    from raytrain_hymt.train.worker import _forward_loss

    rows = packed_rows(2, 1024)
    got = {}
    for fused in (False, True):
        w = build_worker(tmp_path, **{"deepspeed.zero_stage": stage, "model.fused_loss": fused})
        m = w.collate(rows)
        loss = _forward_loss(w.engine, m, fused)
        w.engine.backward(loss)
        params = dict(w.engine.module.named_parameters())
        got[fused] = (float(loss), {n: safe_get_full_grad(params[n]).float().cpu() for n in GRADS})
        release(w)
    (plain, plain_grads), (fused, fused_grads) = got[False], got[True]
    grad_errors = {n: rel_err(fused_grads[n], plain_grads[n]) for n in GRADS}
    print(f"ZeRO-{stage} fused {fused:.4f} vs plain {plain:.4f}; grads {grad_errors}")
    assert math.isfinite(fused) and abs(fused - plain) / plain < LOSS_TOL
    assert max(grad_errors.values()) < GRAD_TOL, grad_errors


def _curve(tmp_path, steps: int = 3, **fields) -> list[float]:
    """Training losses of ``steps`` optimizer steps on fixed packed rows (2 rows of 1024 tokens a step)."""
    rows = packed_rows(2 * steps, 1024)
    w = build_worker(tmp_path, **fields)
    losses = []
    for s in range(steps):
        metrics = w.train_step({k: v[2 * s:2 * s + 2] for k, v in rows.items()})
        assert metrics["train/skipped"] == 0.0
        losses.append(metrics["train/loss"])
    release(w)
    return losses


@pytest.fixture(scope="module")
def eager_zero2(tmp_path_factory):
    return _curve(tmp_path_factory.mktemp("eager"), **{"deepspeed.activation_checkpointing": True})


@pytest.mark.timeout(400)
def test_compiled_layers_give_the_eager_losses(eager_zero2, tmp_path):
    compiled = _curve(tmp_path, **{"deepspeed.activation_checkpointing": True, "model.compile": True})
    print(f"eager {eager_zero2} compiled {compiled}")
    assert all(math.isfinite(x) for x in compiled)
    assert max(abs(a - b) / b for a, b in zip(compiled, eager_zero2)) < LOSS_TOL
    assert eager_zero2[-1] < eager_zero2[0]  # the steps train


@pytest.mark.timeout(300)
def test_bf16_zero3_gives_the_zero2_losses(eager_zero2, tmp_path):
    zero3 = _curve(tmp_path, **{"deepspeed.activation_checkpointing": True, "deepspeed.zero_stage": 3})
    print(f"ZeRO-2 {eager_zero2} ZeRO-3 {zero3}")
    assert max(abs(a - b) / b for a, b in zip(zero3, eager_zero2)) < LOSS_TOL


@pytest.mark.timeout(300)
def test_fp16_skips_an_overflowing_step_and_goes_on(tmp_path):
    from deepspeed.utils import safe_get_full_fp32_param

    w = build_worker(tmp_path, **{"deepspeed.precision": "fp16"})
    rows = packed_rows(8, 1024)
    embed = w.engine.module.get_input_embeddings().weight
    head = w.engine.module.get_output_embeddings().weight
    token = int(rows["input_ids"][0][0])
    saved = embed.data[token].clone()
    before = safe_get_full_fp32_param(head).clone()
    embed.data[token] = float("inf")  # an activation that overflows fp16: the loss and gradients are not finite
    first = w.train_step({k: v[:2] for k, v in rows.items()})
    assert first["train/skipped"] == 1.0 and not math.isfinite(first["train/loss"])
    assert torch.equal(safe_get_full_fp32_param(head), before)  # the update was dropped
    embed.data[token] = saved
    later = [w.train_step({k: v[2 * s:2 * s + 2] for k, v in rows.items()}) for s in range(1, 4)]
    print("fp16 steps:", [(m["train/loss"], m["train/skipped"]) for m in [first, *later]])
    assert all(math.isfinite(m["train/loss"]) for m in later)
    assert any(m["train/skipped"] == 0.0 for m in later)  # it goes on and updates again
    assert not torch.equal(safe_get_full_fp32_param(head), before)
    release(w)
