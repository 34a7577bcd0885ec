"""Mistakes caught before GPUs are spent or data is lost: export target, resume shape, driver preflight."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from raytrain_hymt.train.checkpoint import ResumeMismatchError, RunState, check_same_shape
from raytrain_hymt.train.export import check_export_target
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.driver.session import fewest_workers, resource_shortfall, worker_resources
from raytrain_hymt.driver.train import preflight


def test_export_never_replaces_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a model folder"):
        check_export_target(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    check_export_target(tmp_path / "new")  # a new folder is fine
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    check_export_target(model)  # a previous export is replaced


def test_resuming_with_another_batch_shape_is_refused_with_the_fix():
    state = RunState(step=10, epoch=0, batch_in_epoch=10, world_size=2, tag="step00000010", zero_stage=2,
                     global_rows=4)
    check_same_shape(state, global_rows=4, zero_stage=2)  # any worker count: it is not an argument
    with pytest.raises(ResumeMismatchError) as e:
        check_same_shape(state, global_rows=8, zero_stage=2)
    assert "checkpointed with 4 rows per step (2 workers) and ZeRO-2; now 8 rows per step, ZeRO-2" in str(e.value)
    assert "optim.global_batch_rows=4 to resume on any worker count" in str(e.value)
    with pytest.raises(ResumeMismatchError, match="now 4 rows per step, ZeRO-3"):
        check_same_shape(state, global_rows=4, zero_stage=3)


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


# --------------------------------------------------------------------------------------------------
# Cluster resources: a shortfall on a local Ray fails before the data pipeline; a cluster only warns
# --------------------------------------------------------------------------------------------------

GPU_WORKER = {"CPU": 1.0, "GPU": 1.0}
CPU_FIX = "lower scaling.num_workers or scaling.cpus_per_worker, or raise scaling.local_num_cpus"


def test_gpu_workers_on_a_machine_without_gpus_name_the_fix():
    assert resource_shortfall(GPU_WORKER, 2, {"CPU": 4.0}, [{"CPU": 4.0}]) == (
        "scaling.use_gpu=true needs 2 GPUs (scaling.num_workers=2), this machine has 0 GPUs: use --set "
        "scaling.use_gpu=false, a preset for CPU such as tiny-cpu, or run on a GPU machine / cluster (RAY_ADDRESS)"
    )


def test_a_cluster_short_of_gpus_is_waited_for():
    assert resource_shortfall(GPU_WORKER, 4, {"CPU": 16.0, "GPU": 2.0}, [{"CPU": 16.0, "GPU": 2.0}], local=False) == (
        "scaling.use_gpu=true needs 4 GPUs (scaling.num_workers=4), the cluster now has 2 GPUs; "
        "the job will wait until the autoscaler adds nodes that have them"
    )


def test_too_few_cpus_name_the_workers_and_their_cpus():
    assert resource_shortfall({"CPU": 4.0}, 3, {"CPU": 8.0}, [{"CPU": 8.0}]) == (
        f"scaling.num_workers=3 x scaling.cpus_per_worker=4 needs 12 CPUs, this machine has 8 CPUs: {CPU_FIX}"
    )


def test_enough_in_total_but_no_node_big_enough_for_one_worker():
    nodes = [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}, {"CPU": 8.0}]
    assert resource_shortfall({"CPU": 4.0, "GPU": 1.0}, 2, {"CPU": 12.0, "GPU": 2.0}, nodes, local=False) == (
        "one training worker needs 4 CPUs and 1 GPU on a single node, no node of the cluster now has that "
        "(nodes: 2 x 2 CPUs, 1 GPU; 8 CPUs, 0 GPUs); the job will wait until the autoscaler adds nodes that have them"
    )


def test_enough_everywhere_is_no_shortfall():
    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 4.0, "GPU": 1.0}]
    assert resource_shortfall({"CPU": 4.0, "GPU": 1.0}, 2, {"CPU": 8.0, "GPU": 2.0}, nodes) is None
    # Fractional CPUs add up in floating point (0.1 * 3 > 0.3): still enough.
    assert resource_shortfall({"CPU": 0.1}, 3, {"CPU": 0.3}, [{"CPU": 0.3}]) is None


def test_worker_resources_follow_the_scaling_config():
    assert worker_resources(load_config(None, ["scaling.cpus_per_worker=2"])) == {"CPU": 2.0}
    assert worker_resources(load_config(None, ["scaling.use_gpu=true"])) == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.integration
def test_gpu_run_on_a_machine_without_gpus_fails_before_the_data_pipeline(tmp_path):
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["DS_ACCELERATOR"] = "cpu"
    env["CUDA_VISIBLE_DEVICES"] = ""  # the point is a machine without GPUs, even where the test runs on one
    run = subprocess.run(
        [sys.executable, "jobs/train.py", "--name", "no-gpus", "--set", "scaling.use_gpu=true",
         "--set", f"run.storage_root={tmp_path}", "--set", "optim.max_steps=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-3000:]
    assert ("error: scaling.use_gpu=true needs 2 GPUs (scaling.num_workers=2), this machine has 0 GPUs: "
            "use --set scaling.use_gpu=false") in run.stderr
    assert "data: read" not in out  # stats.summary(): the pipeline never ran
    assert not list((tmp_path / "no-gpus").glob("checkpoint_*"))
    assert not (tmp_path / "no-gpus" / "summary.json").exists()


def test_an_elastic_run_needs_room_for_its_fewest_workers_only(tmp_path):
    elastic = load_config(None, [f"run.storage_root={tmp_path}", "scaling.min_workers=1", "scaling.num_workers=2",
                                 "optim.global_batch_rows=4", "scaling.cpus_per_worker=3"])
    assert fewest_workers(elastic) == (1, "scaling.min_workers")
    assert fewest_workers(load_config()) == (2, "scaling.num_workers")
    need = worker_resources(elastic)
    assert resource_shortfall(need, 1, {"CPU": 4.0}, [{"CPU": 4.0}], workers_field="scaling.min_workers") is None
    assert resource_shortfall(need, 1, {"CPU": 2.0}, [{"CPU": 2.0}], workers_field="scaling.min_workers") == (
        "scaling.min_workers=1 x scaling.cpus_per_worker=3 needs 3 CPUs, this machine has 2 CPUs: lower "
        "scaling.min_workers or scaling.cpus_per_worker, or raise scaling.local_num_cpus")
