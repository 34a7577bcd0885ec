"""Mistakes caught before GPUs are spent or data is lost: export target, resume shape, driver preflight."""

import json

import pytest

from raytrain_hymt.checkpoint import ResumeMismatchError, RunState, _check_export_target, check_same_shape
from raytrain_hymt.config import ConfigError, load_config
from raytrain_hymt.trainer import preflight


def test_export_never_replaces_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a model folder"):
        _check_export_target(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    _check_export_target(tmp_path / "new")  # a new folder is fine
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    _check_export_target(model)  # a previous export is replaced


def test_resuming_with_another_batch_shape_is_refused_with_the_fix():
    state = RunState(step=10, epoch=0, batch_in_epoch=10, world_size=2, tag="step00000010", zero_stage=2,
                     global_rows=4)
    check_same_shape(state, world_size=2, global_rows=4, zero_stage=2)
    with pytest.raises(ResumeMismatchError) as e:
        check_same_shape(state, world_size=4, global_rows=8, zero_stage=2)
    assert "checkpointed with 2 workers, 4 rows per step and ZeRO-2; now 4 workers, 8 rows per step" in str(e.value)
    assert "scaling.num_workers" in str(e.value)


def test_preflight_reads_the_users_deepspeed_json_on_the_driver(tmp_path):
    with pytest.raises(FileNotFoundError):
        preflight(load_config(None, [f"deepspeed.config_file={tmp_path}/missing.json"]))
    conflicting = tmp_path / "ds.json"
    conflicting.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage' is 3 but the config sets 2"):
        preflight(load_config(None, [f"deepspeed.config_file={conflicting}"]))


def test_preflight_needs_a_tracking_server_for_object_store_runs(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError, match="set tracking.tracking_uri"):
        preflight(load_config(None, ["run.storage_root=s3://bucket/runs"]))
    preflight(load_config(None, ["run.storage_root=s3://bucket/runs", "tracking.enabled=false"]))
