"""The engine's pure parts (DeepSpeed config, user JSON merge, schedule, FLOPs/MFU), LoRA wrapping, model
loading from a local folder, and the config rules of the training modes. No Ray here: the modes are
trained under TorchTrainer in tests/integration/test_equivalence.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.train.engine import apply_lora, build_ds_config, lr_factor, merge_user_ds_config
from raytrain_hymt.train.flops import matmul_params, mfu, peak_flops, step_flops
from raytrain_hymt.train.model import load_model
from raytrain_hymt.tokenizer import load_tokenizer


def cfg(*overrides: str):
    return load_config(None, list(overrides))


# --- DeepSpeed config --------------------------------------------------------------------------------


def test_ds_config_of_each_mode():
    ds = build_ds_config(cfg("optim.micro_batch_size=2", "optim.grad_accum=3", "optim.max_grad_norm=0.5",
                             "deepspeed.precision=bf16"), 4, False)
    assert ds["train_batch_size"] == 2 * 3 * 4
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 3
    assert ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 2 and "offload_optimizer" not in ds["zero_optimization"]
    assert ds["bf16"] == {"enabled": True} and ds["fp16"]["enabled"] is False
    assert ds["optimizer"]["params"]["torch_adam"] is True  # no JIT-built fused Adam
    assert "communication_data_type" not in ds

    z3 = build_ds_config(cfg("deepspeed.zero_stage=3", "deepspeed.offload_optimizer=true",
                             "deepspeed.offload_param=true", "deepspeed.precision=fp32",
                             "deepspeed.communication_data_type=fp16"), 2, True)
    zero = z3["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z3["optimizer"]["params"]["torch_adam"] is False  # offload steps with DeepSpeed's CPU Adam
    assert z3["bf16"]["enabled"] is False and z3["communication_data_type"] == "fp16"

    z0 = build_ds_config(cfg("deepspeed.zero_stage=0"), 1, False)
    assert z0["zero_optimization"]["overlap_comm"] is False


def test_a_resume_on_another_worker_count_turns_on_universal_loading(tmp_path):
    # DeepSpeed takes checkpoint.load_universal at initialize only; a user's own checkpoint settings stay.
    assert "checkpoint" not in build_ds_config(cfg(), 2, False)
    assert build_ds_config(cfg(), 2, False, load_universal=True)["checkpoint"] == {"load_universal": True}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"checkpoint": {"tag_validation": "Ignore"}}))
    ds = build_ds_config(cfg(f"deepspeed.config_file={path}"), 2, False, load_universal=True)
    assert ds["checkpoint"] == {"tag_validation": "Ignore", "load_universal": True}


def test_user_json_auto_values_are_filled_and_extras_kept(tmp_path):
    user = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": "auto", "sub_group_size": 1e9}, "bf16": {"enabled": "auto"},
        "wall_clock_breakdown": False,
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(user))
    ds = build_ds_config(cfg(f"deepspeed.config_file={path}", "optim.micro_batch_size=4",
                             "deepspeed.precision=bf16"), 2, False)
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["sub_group_size"] == 1e9  # a key we do not set: the user's value
    assert ds["bf16"] == {"enabled": True}


def test_user_json_conflict_names_file_key_and_both_values():
    ours = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}
    with pytest.raises(ConfigError) as e:
        merge_user_ds_config(ours, {"zero_optimization": {"stage": 3}}, "my_ds.json")
    assert "my_ds.json: 'zero_optimization.stage' is 3 but the config sets 2" in str(e.value)
    with pytest.raises(ConfigError, match=r"'fp16.loss_scale' is \"auto\" but raytrain_hymt does not set it"):
        merge_user_ds_config(ours, {"fp16": {"loss_scale": "auto"}}, "my_ds.json")
    assert merge_user_ds_config(ours, {"gradient_clipping": 1.0}, "x") == ours


# --- learning-rate schedule --------------------------------------------------------------------------


def test_lr_warmup_then_cosine_linear_constant():
    assert [lr_factor(s, 10, 4, "cosine", 0.0) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 10, 4, "cosine", 0.0) == 1.0
    assert lr_factor(7, 10, 4, "cosine", 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 6)))
    assert lr_factor(10, 10, 4, "cosine", 0.1) == pytest.approx(0.1)  # ends at min_lr_ratio
    assert lr_factor(7, 10, 4, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(9, 10, 4, "constant", 0.0) == 1.0
    assert lr_factor(0, 10, 0, "cosine", 0.0) == 1.0  # no warmup: the peak at once


# --- FLOPs and MFU (FACTS.md formula), checked by hand -----------------------------------------------


def test_step_flops_and_mfu_by_hand():
    # 6·N·tokens + 12·L·H·Q·ΣT²: N=100, L=2, H=4, Q=8, documents of 3 and 5 tokens
    assert step_flops(100, 2, 4, 8, [3, 5]) == 6 * 100 * 8 + 12 * 2 * 4 * 8 * (9 + 25) == 30912
    # LoRA: 10 of the 100 get weight gradients: 4·N + 2·T per token, attention unchanged
    assert step_flops(100, 2, 4, 8, [3, 5], trainable_params=10) == (400 + 20) * 8 + 12 * 2 * 4 * 8 * 34 == 29472
    # 30912 FLOPs in 2 s on 2 devices of 10^4 FLOP/s
    assert mfu(30912, 2.0, 2, 1e4) == pytest.approx(30912 / 4e4)
    assert mfu(30912, 2.0, 2, None) is None
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops(None) is None


def test_matmul_params_of_the_tiny_model_by_hand():
    model = load_model("tiny", load_tokenizer("tiny"))
    c = model.config
    hidden, inter, heads, kv, head_dim, vocab = 128, 384, 4, 2, 32, 4032
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.vocab_size) == (hidden, inter, heads, kv, head_dim, vocab)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 2 * head_dim  # q,o k,v + qk norms
    layer = attention + 3 * hidden * inter + 2 * hidden
    # untied: the input embedding is a lookup, not a matmul; the output head is
    assert matmul_params(model) == c.num_hidden_layers * layer + hidden + vocab * hidden == 1_303_936


# --- config rules of the modes -----------------------------------------------------------------------


def test_mode_rules_have_clear_messages():
    with pytest.raises(ConfigError, match="fp16 needs GPUs"):
        cfg("deepspeed.precision=fp16")
    with pytest.raises(ConfigError, match="flex_attention cannot train on CPU"):
        cfg("model.attn_implementation=flex_attention")
    assert cfg("model.attn_implementation=flex_attention", "scaling.use_gpu=true").model.attn_implementation
    with pytest.raises(ConfigError, match="offload_optimizer needs deepspeed.zero_stage >= 1"):
        cfg("deepspeed.zero_stage=0", "deepspeed.offload_optimizer=true")
    with pytest.raises(ConfigError, match="lora.target_modules is empty"):
        cfg("lora.enabled=true", "lora.target_modules=[]")
    with pytest.raises(ConfigError, match=r"lora\.rank.*greater than or equal to 1"):
        cfg("lora.rank=0")


# --- LoRA ----------------------------------------------------------------------------------------------


def test_lora_wraps_hunyuan_attention_and_freezes_the_base():
    model = load_model("tiny", load_tokenizer("tiny"))
    lora = cfg("lora.enabled=true", "lora.rank=4", "lora.alpha=8").lora
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]  # Hunyuan-MT's recipe
    peft_model = apply_lora(model, lora)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 4 * 4 * 2  # layers × q,k,v,o × A,B
    # q_proj: A is r × hidden, B is out × r; scaling alpha / r
    q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.shape == (4, 128) and q.lora_B["default"].weight.shape == (128, 4)
    assert q.scaling["default"] == 2.0
    # FLOPs: only the adapters get weight gradients (A: 4 × in, B: out × 4 for q,k,v,o in 4 layers)
    per_layer = 4 * (128 + 128) + 4 * (128 + 64) + 4 * (128 + 64) + 4 * (128 + 128)
    assert matmul_params(peft_model, trainable_only=True) == 4 * per_layer == 14_336
    assert matmul_params(peft_model) == 1_303_936 + 14_336


def test_lora_unknown_target_lists_the_linear_layers():
    model = load_model("tiny", load_tokenizer("tiny"))
    with pytest.raises(ConfigError, match=r"\['query_key_value'\] are not modules.*'down_proj'.*'q_proj'"):
        apply_lora(model, cfg("lora.target_modules=[query_key_value]").lora)


# --- model loading from a local folder -----------------------------------------------------------------


def test_local_folder_loads_its_own_config_in_bf16(tmp_path):
    """A folder written by save_pretrained: shape and ids come from its config.json (never hard-coded)."""
    from raytrain_hymt.train.model import tiny_model_config

    tok = load_tokenizer("tiny")
    shape = tiny_model_config(4096, num_hidden_layers=2, tie_word_embeddings=True, rms_norm_eps=1e-6,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    saved = AutoModelForCausalLM.from_config(shape)
    saved.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    model = load_model(str(tmp_path), load_tokenizer(str(tmp_path)), dtype=torch.bfloat16)
    assert model.config.model_type == "hunyuan_v1_dense"
    assert (model.config.num_hidden_layers, model.config.vocab_size, model.config.tie_word_embeddings,
            model.config.rms_norm_eps) == (2, 4096, True, 1e-6)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "sdpa"
    for name, p in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], p.to(torch.bfloat16)), name


def test_remote_code_stays_off_unless_asked(tmp_path):
    """A repository that ships its own modelling code is refused unless trust_remote_code is set."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "custom_hymt_probe", "auto_map": {"AutoConfig": "configuration_probe.ProbeConfig",
                                                        "AutoModelForCausalLM": "modeling_probe.ProbeModel"}}))
    (tmp_path / "configuration_probe.py").write_text("raise RuntimeError('remote code ran')\n")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(str(tmp_path), load_tokenizer("tiny"))


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    tok = load_tokenizer("tiny")
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(str(tmp_path))
    assert again.pad_token == again.eos_token == "<|eos|>"


# --- the real-model presets --------------------------------------------------------------------------


@pytest.mark.parametrize("preset, stage, offload, lora", [
    ("hy-mt-7b-zero3", 3, False, False), ("hy-mt-7b-zero2", 2, False, False),
    ("hy-mt-7b-offload", 3, True, False), ("hy-mt-7b-lora", 2, False, True), ("hy-mt-7b-lora-fast", 2, False, True),
])
def test_real_model_presets(preset, stage, offload, lora):
    c = load_config(preset)
    assert c.model.name_or_path == "tencent/Hunyuan-MT-7B" and not c.model.trust_remote_code
    assert c.scaling.use_gpu and c.deepspeed.precision == "bf16" and c.optim.schedule == "cosine"
    assert c.data.packing and c.model.attn_implementation == "flex_attention"
    assert c.lora.enabled is lora and c.optim.lr == (1e-4 if lora else 1e-5)
    ds = build_ds_config(c, 8, on_gpu=True)
    assert ds["zero_optimization"]["stage"] == stage
    assert ("offload_optimizer" in ds["zero_optimization"]) is offload
    assert ("offload_param" in ds["zero_optimization"]) is offload
    assert ds["bf16"]["enabled"] is True
    if preset.startswith("hy-mt-7b-lora"):  # the lean one checkpoints activations, the fast one compiles
        fast = preset.endswith("-fast")
        assert (c.deepspeed.activation_checkpointing, c.model.compile) == (not fast, fast)
