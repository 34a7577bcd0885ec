"""The frozen output projection stored in a multiple of 64 rows (``model.align_frozen_head``): the same
logits and adapter gradients, the same weights in the state dict and in a saved folder. Hunyuan's real
vocabulary (128,167) is odd; the tiny model's is padded already, so these tests build an odd one (1,001)."""

import pytest
import torch

from raytrain_hymt.config.schema import LoraConfig
from raytrain_hymt.train.engine import apply_lora
from raytrain_hymt.train.model import align_frozen_head, tiny_model_config

VOCAB = 1001


def _lora_model(tied: bool):
    from transformers import HunYuanDenseV1ForCausalLM

    torch.manual_seed(0)
    model = HunYuanDenseV1ForCausalLM(tiny_model_config(VOCAB, tie_word_embeddings=tied, num_hidden_layers=2))
    model = apply_lora(model, LoraConfig(enabled=True, rank=4, alpha=8, dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # non-zero, so that the adapters take part in the logits
            torch.nn.init.normal_(p, std=0.02)
    return model


def _logits_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tied", [False, True])
def test_an_aligned_head_gives_the_same_logits_gradients_and_weights(tied, tmp_path):
    model = _lora_model(tied)
    ids = torch.randint(0, VOCAB, (2, 24))
    before, grads_before = _logits_and_grads(model, ids)
    weight_before = model.get_output_embeddings().weight.detach().clone()

    assert align_frozen_head(model)
    weight = model.get_output_embeddings().weight
    assert weight.shape == (VOCAB, 128) and weight.untyped_storage().nbytes() == 1024 * 128 * 4
    hidden = torch.randn(3, 128)
    assert model.get_output_embeddings()(hidden).stride() == (1024, 1)  # the padded matmul, not a fallback
    after, grads_after = _logits_and_grads(model, ids)

    assert after.shape == before.shape == (2, 24, VOCAB)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    assert grads_after.keys() == grads_before.keys() and len(grads_after) == 2 * 4 * 2  # A and B of q/k/v/o, 2 layers
    for name in grads_before:
        torch.testing.assert_close(grads_after[name], grads_before[name], rtol=1e-5, atol=1e-7)
    assert torch.equal(model.state_dict()[next(k for k in model.state_dict() if k.endswith("lm_head.weight"))],
                       weight_before)
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path / "out")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.get_output_embeddings().weight, weight_before)


def test_a_trained_or_already_aligned_head_is_left_alone():
    model = _lora_model(tied=False)
    model.get_output_embeddings().weight.requires_grad_(True)
    assert not align_frozen_head(model)  # full fine-tuning: DeepSpeed owns the trained weights
    from transformers import HunYuanDenseV1ForCausalLM

    aligned = HunYuanDenseV1ForCausalLM(tiny_model_config(1024, num_hidden_layers=1)).requires_grad_(False)
    assert not align_frozen_head(aligned)
