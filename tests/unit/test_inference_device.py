"""Where ``hymt translate`` and ``hymt evaluate`` run the model: the decision's whole table, and which
settings count as the user's choice for it (``--set``, a ``--config`` the user names; never the default)."""

from __future__ import annotations

import itertools

import pytest

from raytrain_hymt.driver.evaluate import explicit_device_settings, inference_device, inference_overrides

# Nothing chosen: (cuda_available, bf16_supported) → (use_gpu, precision).
AUTOMATIC = {
    (True, True): (True, "bf16"),
    (True, False): (True, "fp16"),
    (False, True): (False, "fp32"),
    (False, False): (False, "fp32"),
}
# Only scaling.use_gpu chosen: (use_gpu, bf16_supported) → precision, whatever cuda_available says.
FORCED_DEVICE = {
    (True, True): "bf16",
    (True, False): "fp16",
    (False, True): "fp32",
    (False, False): "fp32",
}


@pytest.mark.parametrize("cuda,bf16", list(AUTOMATIC))
def test_nothing_chosen_means_the_gpu_in_bf16_else_fp16_and_the_cpu_in_fp32(cuda, bf16):
    assert inference_device({}, cuda, bf16) == AUTOMATIC[cuda, bf16]


@pytest.mark.parametrize("use_gpu,cuda,bf16", list(itertools.product([True, False], repeat=3)))
def test_a_chosen_device_is_kept_and_the_precision_follows_it(use_gpu, cuda, bf16):
    assert inference_device({"scaling.use_gpu": use_gpu}, cuda, bf16) == (use_gpu, FORCED_DEVICE[use_gpu, bf16])


@pytest.mark.parametrize("precision,cuda,bf16", list(itertools.product(["bf16", "fp16", "fp32"], [True, False],
                                                                       [True, False])))
def test_a_chosen_precision_is_kept_on_the_automatic_device(precision, cuda, bf16):
    assert inference_device({"deepspeed.precision": precision}, cuda, bf16) == (cuda, precision)


@pytest.mark.parametrize("use_gpu,precision,cuda,bf16", list(itertools.product(
    [True, False], ["bf16", "fp16", "fp32"], [True, False], [True, False])))
def test_both_chosen_are_both_kept(use_gpu, precision, cuda, bf16):
    explicit = {"scaling.use_gpu": use_gpu, "deepspeed.precision": precision}
    assert inference_device(explicit, cuda, bf16) == (use_gpu, precision)


def test_the_users_set_and_named_config_are_choices_the_default_preset_is_not(tmp_path):
    assert explicit_device_settings(None, ["eval.batch_size=8", "run.name=x"]) == {}
    assert explicit_device_settings(None, ["scaling.use_gpu=false", "deepspeed.precision = bf16",
                                           "scaling.use_gpu=true"]) == {"scaling.use_gpu": True,
                                                                        "deepspeed.precision": "bf16"}
    # A preset named on the command line chooses what it sets, and --set wins over it.
    assert explicit_device_settings("hy-mt-7b-lora", []) == {"deepspeed.precision": "bf16", "scaling.use_gpu": True}
    assert explicit_device_settings("tiny-cpu", []) == {"deepspeed.precision": "fp32"}
    assert explicit_device_settings("hy-mt-7b-lora", ["scaling.use_gpu=false"]) == {
        "deepspeed.precision": "bf16", "scaling.use_gpu": False}
    own = tmp_path / "mine.yaml"
    own.write_text("eval:\n  batch_size: 8\n")
    assert explicit_device_settings(str(own), []) == {}
    own.write_text("scaling: [not, a, section\n")  # load_config reports the file; the choice is only skipped
    assert explicit_device_settings(str(own), []) == {}


def test_the_automatic_fields_become_overrides_after_the_users(monkeypatch):
    # Stands in for this machine's torch.cuda: a GPU without bf16 (a V100), then a CPU-only machine.
    monkeypatch.setattr("raytrain_hymt.driver.evaluate.local_gpu", lambda: (True, False))
    assert inference_overrides({}) == ["scaling.use_gpu=true", "deepspeed.precision=fp16"]
    assert inference_overrides({"scaling.use_gpu": False}) == ["deepspeed.precision=fp32"]
    monkeypatch.setattr("raytrain_hymt.driver.evaluate.local_gpu", lambda: (False, False))
    assert inference_overrides({}) == ["scaling.use_gpu=false", "deepspeed.precision=fp32"]
    assert inference_overrides({"deepspeed.precision": "bf16"}) == ["scaling.use_gpu=false"]
    assert inference_overrides({"scaling.use_gpu": True, "deepspeed.precision": "bf16"}) == []
