"""Config: presets load and validate; overrides apply; mistakes name the field before Ray starts."""

import pytest

from raytrain_hymt.config.schema import Config, flatten, load_config, parse_override, preset_names, to_yaml
from raytrain_hymt.errors import ConfigError


def test_default_preset_is_tiny_cpu():
    cfg = load_config()
    assert cfg.preset == "tiny-cpu"
    assert cfg.model.name_or_path == "tiny"
    assert cfg.deepspeed.zero_stage == 2
    assert cfg.scaling.num_workers == 2
    assert cfg.data.sources[0].path == "sample:"


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_loads_and_round_trips(preset):
    cfg = load_config(preset)
    assert cfg.preset == preset
    again = Config.model_validate(__import__("yaml").safe_load(to_yaml(cfg)))
    assert again == cfg


def test_overrides_are_parsed_as_yaml_values():
    cfg = load_config(None, ["optim.lr=3e-5", "deepspeed.zero_stage=3", "run.name=abc", "data.val_fraction=0"])
    assert cfg.optim.lr == 3e-5
    assert cfg.deepspeed.zero_stage == 3
    assert cfg.run.name == "abc"
    assert cfg.data.val_fraction == 0
    assert parse_override("optim.betas=[0.9, 0.99]") == ("optim.betas", [0.9, 0.99])


def test_invalid_value_names_the_field():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["deepspeed.zero_stage=4"])
    assert "deepspeed.zero_stage" in str(e.value)
    assert "(got 4, from --set deepspeed.zero_stage=4)" in str(e.value)


def test_unknown_field_names_the_field():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.learning_rate=1e-4"])
    assert str(e.value) == ("invalid configuration:\n  optim.learning_rate: unknown field (got '1e-4', from --set "
                            "optim.learning_rate=1e-4); did you mean optim.lr?")


@pytest.mark.parametrize("field, hint", [
    ("optim.lrr", "did you mean optim.lr?"),  # a typo: the nearest field of the section
    ("optim.seed", "did you mean data.seed or run.seed or tune.seed?"),  # a field of other sections
    ("lora.r", "did you mean lora.rank?"),  # another tool's name
    ("data.cutoff_len", "did you mean data.max_example_tokens?"),
    ("optimizer.lr", "did you mean optim?"),
    ("optim.foo", "optim has: lr, min_lr_ratio, warmup_steps, schedule, weight_decay, betas, eps, max_grad_norm, "
                  "micro_batch_size, grad_accum, global_batch_rows, max_steps, epochs"),
])
def test_an_unknown_field_gets_the_field_meant(field, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{field}=1"])
    assert str(e.value).endswith(f"; {hint}")


def test_an_unknown_field_in_a_yaml_file_and_a_list_item_get_hints_too(tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("optim:\n  gradient_accumulation_steps: 4\ndata:\n  sources:\n    - {path: c.tsv, fmt: tsv}\n"
                      "    - {path:x}\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(preset))
    lines = str(e.value).splitlines()
    assert f"  optim.gradient_accumulation_steps: unknown field (got 4, from {preset}); did you mean optim.grad_accum?" in lines
    assert f"  data.sources.0.fmt: unknown field (got 'tsv', from {preset}); did you mean data.sources[0].format?" in lines
    assert (f"  data.sources.1.path:x: unknown field (got None, from {preset}); write 'path: x' with a space after "
            "the colon (YAML)") in lines


def test_every_alias_names_a_real_field():
    from raytrain_hymt.config.schema import FIELD_ALIASES, Config, flatten

    fields = set(flatten(Config().model_dump(mode="json")))
    assert {target for target in FIELD_ALIASES.values() if target not in fields} == set()


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="offload_param needs deepspeed.zero_stage 3"):
        load_config(None, ["deepspeed.offload_param=true"])
    with pytest.raises(ConfigError, match="fp16 needs GPUs"):
        load_config(None, ["deepspeed.precision=fp16"])
    with pytest.raises(ConfigError, match="pack_tokens"):
        load_config(None, ["data.pack_tokens=64", "data.max_example_tokens=128"])


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="presets: .*tiny-cpu"):
        load_config("no-such-preset")


def test_malformed_override():
    with pytest.raises(ConfigError, match="expected section.field=value"):
        load_config(None, ["optim.lr"])


def test_every_field_has_a_docstring():
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, __import__("pydantic").BaseModel):
                walk(ann, f"{prefix}{name}.")
            else:
                assert field.description, f"{prefix}{name} has no docstring"

    walk(Config)


def test_storage_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config()
    assert cfg.run.storage_path == str(tmp_path / "hymt_runs")
    assert flatten({"a": {"b": 1, "c": [1]}}) == {"a.b": 1, "a.c": [1]}


def test_global_batch_rows_fixes_the_global_batch_on_any_worker_count():
    from raytrain_hymt.train.engine import build_ds_config

    cfg = load_config(None, ["optim.global_batch_rows=8", "optim.micro_batch_size=2", "scaling.num_workers=2"])
    opt = cfg.optim
    assert [(w, opt.accumulation(w), opt.rows_per_step(w)) for w in (1, 2, 4)] == [(1, 4, 8), (2, 2, 8), (4, 1, 8)]
    ds = build_ds_config(cfg, 4, False)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"]) == (8, 1, 2)
    # Unset, the global batch follows the worker count (the default job's shape: 2 × 1 × 2).
    default = load_config().optim
    assert default.global_batch_rows is None and [default.rows_per_step(w) for w in (1, 2)] == [2, 4]


def test_a_global_batch_that_does_not_divide_names_the_fields():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.global_batch_rows=6", "optim.micro_batch_size=2", "scaling.num_workers=2"])
    assert ("optim.global_batch_rows (6) is not a multiple of scaling.num_workers (2) × optim.micro_batch_size (2) "
            "= 4") in str(e.value)
    opt = load_config(None, ["optim.global_batch_rows=8", "optim.micro_batch_size=2"]).optim
    with pytest.raises(ConfigError, match=r"scaling.num_workers \(3\) × optim.micro_batch_size \(2\) = 6"):
        opt.accumulation(3)  # what a worker group of another size (elastic, resume) is told
    with pytest.raises(ConfigError, match=r"optim.grad_accum \(2\) and optim.global_batch_rows \(8\) are both set"):
        load_config(None, ["optim.global_batch_rows=8", "optim.grad_accum=2"])


def test_elastic_scaling_reaches_ray_train_and_every_worker_count_keeps_the_global_batch():
    from raytrain_hymt.driver.train import scaling_config

    elastic = ["scaling.min_workers=1", "scaling.num_workers=2", "optim.global_batch_rows=4",
               "scaling.elastic_resize_monitor_interval_s=2.5"]
    cfg = load_config(None, elastic)
    assert list(cfg.scaling.worker_counts) == [1, 2]
    assert [cfg.optim.accumulation(n) for n in cfg.scaling.worker_counts] == [2, 1]  # micro-batch 2
    scaling = scaling_config(cfg)
    assert (scaling.num_workers, scaling.elasticity_enabled, scaling.elastic_resize_monitor_interval_s,
            scaling.resources_per_worker) == ((1, 2), True, 2.5, {"CPU": 1.0})
    fixed = scaling_config(load_config())
    assert (fixed.num_workers, fixed.elasticity_enabled, fixed.elastic_resize_monitor_interval_s) == (2, False, 60.0)
    assert list(load_config().scaling.worker_counts) == [2]


@pytest.mark.parametrize("sets,message", [
    (["scaling.min_workers=1", "scaling.num_workers=4", "optim.global_batch_rows=4", "optim.micro_batch_size=1"],
     "optim.global_batch_rows (4) does not split into whole micro-batches (optim.micro_batch_size 1) on 3 worker(s), "
     "and an elastic run may restart on any count from scaling.min_workers to scaling.num_workers (1..4). Counts up "
     "to 4 that divide it: 1, 2, 4; choose min_workers and num_workers so that every count between them does, or a "
     "global batch that is a multiple of 12"),
    (["scaling.min_workers=1"],
     "scaling.min_workers (elastic training) needs optim.global_batch_rows: without it the global batch is workers × "
     "optim.grad_accum × optim.micro_batch_size and changes whenever the worker count does"),
    (["scaling.min_workers=3", "optim.global_batch_rows=12"],
     "scaling.min_workers (3) must be at most scaling.num_workers (2), the most workers of an elastic run"),
    (["scaling.min_workers=1", "optim.global_batch_rows=4", "scaling.cpus_per_worker=0.5"],
     "scaling.cpus_per_worker must be a whole number in an elastic run (scaling.min_workers set), got 0.5"),
    (["scaling.min_workers=0"], "scaling.min_workers: Input should be greater than or equal to 1"),
    (["scaling.min_workers=1", "optim.global_batch_rows=4", "scaling.elastic_resize_monitor_interval_s=-1"],
     "scaling.elastic_resize_monitor_interval_s: Input should be greater than or equal to 0"),
], ids=["count-does-not-divide", "no-global-batch", "min-over-max", "fractional-cpus", "min-zero", "negative-interval"])
def test_elastic_scaling_mistakes_name_the_fields(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert message in str(e.value)
