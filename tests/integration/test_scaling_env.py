"""``scaling.env``: validated as environment variables, passed to the workers, redacted from MLflow."""

from __future__ import annotations

import json
import os

import pytest
from mlflow import MlflowClient

from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError

SECRET = "wJalrXUtnFEMI-K7MDENG-9090"
#: The NCCL settings of the README's environment-variables table plus an object store's credentials.
ENV = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": 1, "NCCL_ALGO": "Ring",
       "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": SECRET, "HF_TOKEN": SECRET}


def _env_overrides(env: dict) -> list[str]:
    return [f"scaling.env.{k}={v}" for k, v in env.items()]


def test_env_values_become_text_and_bad_names_are_refused():
    cfg = load_config(None, _env_overrides(ENV))
    assert cfg.scaling.env["NCCL_IB_DISABLE"] == "1"  # `--set` parsed 1 as YAML: a number, written as text
    assert cfg.scaling.env["NCCL_ALGO"] == "Ring"
    assert load_config(None).scaling.env == {}
    with pytest.raises(ConfigError, match=r"scaling\.env: Value error, '1NCCL' is not an environment variable name"):
        load_config(None, ["scaling.env={1NCCL: x}"])
    with pytest.raises(ConfigError, match=r"scaling\.env: Value error, NCCL_IB_DISABLE: give text or a number \(got True\)"):
        load_config(None, ["scaling.env.NCCL_IB_DISABLE=true"])


def test_secret_env_values_are_redacted_from_mlflow_params(tmp_path, monkeypatch):
    from raytrain_hymt.driver.runs import start_tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [f"run.storage_root={tmp_path}", "run.name=envs", *_env_overrides(ENV)])
    run_dir = tmp_path / "envs"
    run_dir.mkdir()
    tracker, uri = start_tracking(cfg, run_dir)
    tracker.finish("FINISHED")
    run = MlflowClient(uri).get_run(tracker.run_id)
    params = {k: v for k, v in run.data.params.items() if k.startswith("scaling.env.")}
    assert params == {
        "scaling.env.NCCL_DEBUG": "INFO", "scaling.env.NCCL_SOCKET_IFNAME": "eth0", "scaling.env.NCCL_IB_DISABLE": "1",
        "scaling.env.NCCL_ALGO": "Ring", "scaling.env.AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",  # an id, not a secret
        "scaling.env.AWS_SECRET_ACCESS_KEY": "***", "scaling.env.HF_TOKEN": "***",
    }
    config_yaml = MlflowClient(uri).download_artifacts(tracker.run_id, "config.yaml", str(tmp_path / "dl"))
    text = open(config_yaml).read()
    assert SECRET not in text and "NCCL_SOCKET_IFNAME: eth0" in text


@pytest.mark.integration
def test_every_worker_gets_the_env_and_deepspeeds_accelerator_through_its_runtime_env(ray_session, tmp_path):
    import ray.data
    import ray.train

    from raytrain_hymt.driver.train import build_trainer

    names = ["NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "DS_ACCELERATOR"]

    def report_env(config):  # defined here: Ray pickles a test module's functions by value only when local
        seen = {n: os.environ.get(n) for n in config["names"]}  # before DeepSpeed is imported
        from deepspeed.accelerator import get_accelerator

        seen["deepspeed"] = get_accelerator().device_name()
        rank = ray.train.get_context().get_world_rank()
        with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)

    cfg = load_config(None, [f"run.storage_root={tmp_path}", "run.name=env-workers",
                             "scaling.env.NCCL_SOCKET_IFNAME=lo", "scaling.env.NCCL_IB_DISABLE=1"])
    assert "NCCL_SOCKET_IFNAME" not in os.environ  # only the runtime environment can bring it to a worker
    rows = ray.data.from_items([{"x": 0}])
    build_trainer(cfg, rows, rows, {"out": str(tmp_path), "names": names}, loop=report_env).fit()
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(cfg.scaling.num_workers)]
    # DeepSpeed's accelerator is the CPU because the environment named it (the product's one setting,
    # config.schema.deepspeed_accelerator_env), not because DeepSpeed found no GPU: this test's process sets
    # no DS_ACCELERATOR, and without the product's setting the workers would see none.
    assert "DS_ACCELERATOR" not in os.environ or os.environ["DS_ACCELERATOR"] == "cpu"
    assert seen == [{"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "DS_ACCELERATOR": "cpu",
                     "deepspeed": "cpu"}] * 2
