"""Shared fixtures: one local Ray cluster per test session, the tiny config, the data the tests read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ray reads these once, when it starts. A stopped trial's or a failed worker's detection waits for this
# interval: 0.25 s instead of Ray's 2 s lets the failure tests end sooner.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Ray Train starts a preemption-watcher actor with every fit; it only logs node drains, which no test's fit
# has (the two-node test kills its node with SIGKILL).
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The dashboard's node view and Prometheus metrics, which no test reads, poll every Ray process of this
# 2-core machine: the log monitor every 0.5 s instead of 0.1 s, the reporter every minute, no metrics.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
os.environ.setdefault("RAY_enable_metrics_collection", "0")
# A test's tracking and cluster come from its config and fixtures, never from the machine's environment.
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("RAY_ADDRESS", None)

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

#: Small real data shipped with the tests, each with its source and license (``tests/assets/*/SOURCE.md``),
#: so that a fresh clone runs every data test; a missing file fails the test that reads it.
ASSETS = REPO / "tests" / "assets"
#: FLORES-200 devtest, the first 200 sentences in zh, en, de and ja.
FLORES_DEVTEST = ASSETS / "flores200" / "devtest"
#: Tatoeba deu-eng, the first 500 lines (the eng-zho set is the package's own sample, ``SAMPLE_CORPUS``).
TATOEBA_DEU_ENG = ASSETS / "tatoeba" / "deu-eng.test.tsv"


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (starting Ray costs seconds; every integration test shares it)."""
    import ray

    from raytrain_hymt.console.quiet import quiet_ray
    from raytrain_hymt.driver.session import start_local_ray

    quiet_ray()
    # 2 training workers + tokenizer actors + a second concurrent job need more logical CPUs than 2 cores.
    # A local Ray as session.init_ray starts it: the dashboard, whose State API Ray Train's cleaner asks
    # to free a stopped trial's workers, and every process pointed at it.
    start_local_ray(8, log_to_driver=True)
    yield ray
    ray.shutdown()


#: The session's loopback clusters (``two_node_cluster``), stopped after the last test that uses one.
_CLUSTERS: list = []
_LAST_CLUSTER_USER: list[str] = []


@pytest.fixture(scope="session")
def _two_node_session():
    from ray_cluster import LoopbackCluster

    cluster = LoopbackCluster(num_cpus=5, worker_nodes=(3,))
    _CLUSTERS.append(cluster)
    yield cluster
    cluster.close()


@pytest.fixture
def two_node_cluster(_two_node_session):
    """One ``ray start`` cluster on loopback for the session (a cluster costs ~20 s to start and stop): a
    head of 5 logical CPUs and a second node of 3, so two workers of 3 CPUs each land on different nodes.
    Shared by the job-submission tests (``ray job submit``) and the node-loss and elastic tests, which
    connect a driver process to it; a test that kills the second node gets it back after it ends."""
    yield _two_node_session
    _two_node_session.restore()


def pytest_collection_modifyitems(config, items):
    # tests/integration starts Ray, DeepSpeed's processes, MLflow servers or the CLI as a subprocess;
    # tests/unit starts none of them (its guard below fails a unit test that starts Ray).
    for item in items:
        if (TESTS / "integration") in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
    users = [item.nodeid for item in items if "two_node_cluster" in getattr(item, "fixturenames", ())]
    _LAST_CLUSTER_USER[:] = users[-1:]


@pytest.hookimpl(trylast=True)  # after the item's own fixtures are torn down (two_node_cluster's restore)
def pytest_runtest_teardown(item, nextitem):
    # The tests after the cluster's last user need its CPU and memory (an idle cluster's raylets and
    # dashboard still run): stop it there, not at the end of the session.
    if _LAST_CLUSTER_USER and item.nodeid == _LAST_CLUSTER_USER[0]:
        for cluster in _CLUSTERS:
            cluster.close()


def tiny_overrides(storage: Path, **extra: object) -> list[str]:
    """``--set`` overrides for a short tiny-cpu run stored under ``storage``: packed rows of 256 tokens
    (the preset's longest example) instead of 1024, a quarter of the preset's step time on a CPU worker
    (tests/integration/test_default_job.py runs the preset itself)."""
    values = {
        "run.storage_root": str(storage),
        "data.pack_tokens": 256,
        "optim.max_steps": 20,
        "checkpoint.every_steps": 10,
        "eval.every_steps": 10,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def save_model_folder(folder: Path, **shape: object) -> str:
    """A model folder of the tiny architecture (seed 0; ``shape`` overrides its config, e.g. a larger
    ``hidden_size``), saved with the tiny tokenizer: what ``from_pretrained`` loads, the path every real
    run takes (a model built from its config is in train mode, a loaded one is not)."""
    import torch
    from transformers import AutoModelForCausalLM

    from raytrain_hymt.train.model import tiny_model_config
    from raytrain_hymt.tokenizer import load_tokenizer, padded_vocab_size

    tok = load_tokenizer("tiny")
    torch.manual_seed(0)
    config = tiny_model_config(padded_vocab_size(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, **shape)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


#: The end-of-run test set of ``finished_run``: FLORES-200 devtest, 4 sentences each way, short outputs.
E2E_EVAL = {"eval.directions": "[en-zh, zh-en]", "eval.max_sentences": 4, "eval.max_new_tokens": 16}


@pytest.fixture(scope="session")
def finished_run(ray_session, tmp_path_factory):
    """One finished 20-step tiny run named ``e2e`` (checkpoints, MLflow, export, BLEU/chrF on FLORES at
    steps 10 and 20 and at the end),
    shared by the end-to-end and evaluation tests: ``(storage root, TrainingSummary)``."""
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.driver.train import run_training

    storage = tmp_path_factory.mktemp("runs")
    extra = {"run.name": "e2e", "eval.test_set": FLORES_DEVTEST, **E2E_EVAL,
             # BLEU during training on the rows the end-of-run evaluation scores (tests/integration/test_train_bleu.py).
             "eval.bleu_every_steps": 10, "eval.bleu_sentences": E2E_EVAL["eval.max_sentences"]}
    summary = run_training(load_config(None, tiny_overrides(storage, **extra)))
    return storage, summary


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ray(request):
    """A test under tests/unit that starts Ray in this process fails: it belongs in tests/integration. (A Ray
    already up when it began is an integration test's, in a whole-suite run.)"""
    import sys

    unit = (TESTS / "unit") in Path(str(request.node.fspath)).parents
    ray = sys.modules.get("ray")
    was_up = ray is not None and ray.is_initialized()
    yield
    if unit and not was_up:
        ray = sys.modules.get("ray")
        assert ray is None or not ray.is_initialized(), f"{request.node.nodeid} started Ray: move it to tests/integration"
