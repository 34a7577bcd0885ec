"""raytrain_hymt.driver.tune: the pure parts (search space, concurrency, result table, best preset) and one real
search on CPU (Ray Tune + Ray Train + DeepSpeed + MLflow, tiny model): 3 trials of one worker each,
interrupted after the first trial and continued by running it again."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import tiny_overrides
from mlflow_server import free_port
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.driver.tune import BEST_PRESET, STOPPED_EARLY_TAG, run_search
from raytrain_hymt.driver.tune import (TrialRow, best_preset_yaml, best_trial, grid_points, max_concurrent_trials, num_trials,
                                     search_dimensions, table_lines, trial_config, trial_line, trial_resources)

# In the preset's order: each of the first three learns faster than the one before (so run one at a time,
# ASHA keeps them), 1e-6 barely moves the random model (ASHA must stop it at its first rung).
LRS = [3e-4, 1e-3, 3e-3, 1e-6]
#: The real search's grid: two that learn, the faster second (ASHA keeps both), and the hopeless one. A
#: trial is a whole TorchTrainer fit (~25 s here): the preset's fourth would show nothing these do not.
SEARCH_LRS = LRS[1:]


def _row(trial_id, lr, val, steps, status="done"):
    return TrialRow(trial_id=trial_id, params={"optim.lr": lr}, val_loss=val, steps=steps,
                    stopped_early=status == "stopped", status=status, run_dir=f"/r/trial-{trial_id}",
                    checkpoint=f"/r/trial-{trial_id}/checkpoint_step{steps:08d}")


# ---- pure functions ----------------------------------------------------------------------------------


def test_search_space_grid_range_and_optional_dimensions():
    cfg = load_config("tune-tiny-cpu")
    assert search_dimensions(cfg) == {"optim": {"lr": LRS}}
    assert num_trials(cfg) == 4
    cfg = load_config("tune-tiny-cpu", ["tune.lr_grid=null", "tune.lr_range=[1e-5, 1e-3]", "tune.num_samples=3",
                                        "tune.warmup_steps=[0, 10]", "tune.lora_rank=[8, 16]"])
    assert search_dimensions(cfg) == {"optim": {"lr": ("loguniform", 1e-5, 1e-3), "warmup_steps": [0, 10]},
                                      "lora": {"rank": [8, 16]}}
    assert num_trials(cfg) == 3 * 2 * 2
    points = grid_points(cfg)  # range ends × grid: what is validated before Ray starts
    assert len(points) == 2 * 2 * 2
    assert points[0] == {"optim": {"lr": 1e-5, "warmup_steps": 0}, "lora": {"rank": 8}}
    trial = trial_config(cfg, points[-1])
    assert (trial.optim.lr, trial.optim.warmup_steps, trial.lora.rank, trial.lora.enabled) == (1e-3, 10, 16, True)
    assert cfg.lora.enabled is False  # the base is not changed


def test_search_config_mistakes_are_named():
    with pytest.raises(ConfigError, match="no 'tune' section"):
        search_dimensions(load_config(None))
    with pytest.raises(ConfigError, match="exactly one of tune.lr_grid"):
        load_config("tune-tiny-cpu", ["tune.lr_range=[1e-5, 1e-3]"])
    with pytest.raises(ConfigError, match=r"tune.lr_range must be \[low, high\]"):
        load_config("tune-tiny-cpu", ["tune.lr_grid=null", "tune.lr_range=[1e-3, 1e-5]"])
    with pytest.raises(ConfigError, match="optim.warmup_steps"):
        trial_config(load_config("tune-tiny-cpu"), {"optim": {"warmup_steps": -1}})


def test_max_concurrent_trials_from_cluster_resources():
    cpu = load_config("tune-tiny-cpu", ["tune.max_concurrent_trials=null"])  # 1 worker + 0.5 CPU driver, 4 trials
    assert trial_resources(cpu) == {"CPU": 1.5}
    assert max_concurrent_trials({"CPU": 8.0}, cpu) == 4  # capped by the number of trials
    assert max_concurrent_trials({"CPU": 4.0}, cpu) == 2
    assert max_concurrent_trials({"CPU": 8.0}, load_config("tune-tiny-cpu")) == 2  # the preset's own cap
    assert max_concurrent_trials({"CPU": 2.0}, load_config("tune-tiny-cpu")) == 1
    gpu = load_config("tune-tiny-cpu", ["scaling.use_gpu=true", "scaling.num_workers=2", "tune.max_concurrent_trials=null"])
    assert trial_resources(gpu) == {"CPU": 2.5, "GPU": 2.0}
    assert max_concurrent_trials({"CPU": 64.0, "GPU": 5.0}, gpu) == 2  # GPUs limit: 5 // 2
    with pytest.raises(ConfigError, match=r"one trial needs \{'CPU': 2.5, 'GPU': 2.0\}.*has \{'CPU': 64.0, 'GPU': 1.0\}"):
        max_concurrent_trials({"CPU": 64.0, "GPU": 1.0}, gpu)


def test_best_trial_table_and_preset(tmp_path):
    rows = [_row("a", 3e-3, 6.5, 8), _row("b", 1e-3, 6.1, 8), _row("c", 3e-4, 5.0, 2, "stopped"),
            _row("d", 1e-6, None, 0, "error: RuntimeError")]
    best = best_trial(rows)
    assert best.trial_id == "b"  # c's loss is lower but from step 2 (stopped early): not comparable
    assert best_trial([rows[2], rows[3]]).trial_id == "c"  # nothing finished: the best of what ran
    assert best_trial([rows[3]]) is None
    assert table_lines(rows) == [
        "trial  optim.lr  val_loss  steps  stopped_early  status",
        "c      0.0003    5.0000    2      yes            stopped",
        "b      0.001     6.1000    8      no             done",
        "a      0.003     6.5000    8      no             done",
        "d      1e-06     -         0      no             error: RuntimeError",
    ]
    cfg = load_config("tune-tiny-cpu", tiny_overrides(tmp_path, **{"run.name": "s"}))
    text = best_preset_yaml(cfg, best, "s")
    assert text.startswith("# Best trial (b) of the search 's': optim.lr=0.001; validation loss 6.1000 after 8 steps.")
    preset = tmp_path / BEST_PRESET
    preset.write_text(text)
    again = load_config(str(preset))
    assert again.optim.lr == 1e-3 and again.tune is None and again.run.name is None
    assert again.model_dump(exclude={"preset", "tune", "run", "optim"}) == cfg.model_dump(exclude={"preset", "tune", "run", "optim"})


# ---- a real search -----------------------------------------------------------------------------------


def _interrupt_when(search_dir: Path, pattern: str, count: int, timeout_s: float = 900) -> threading.Thread:
    """Send this process SIGUSR1 (Tune's stop signal, like Ctrl+C) once ``count`` files match ``pattern``
    under ``search_dir``: the search stops, saving its state, as an interrupted job would."""

    def watch():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(list(search_dir.glob(pattern))) >= count:
                os.kill(os.getpid(), signal.SIGUSR1)
                return
            time.sleep(0.5)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def search(ray_session, tmp_path_factory):
    storage = tmp_path_factory.mktemp("tune")
    overrides = tiny_overrides(storage, **{
        "run.name": "lr-search", "optim.max_steps": 8, "eval.every_steps": 2, "checkpoint.every_steps": 4,
        "tune.grace_period_steps": 2, "tune.max_concurrent_trials": 1,  # one at a time: ASHA's order is fixed
        "tune.lr_grid": str(SEARCH_LRS),
    })
    started = time.monotonic()
    # What each attempt prints (Tune writes its tables with print) and logs through the project's logger.
    printed, logged = [io.StringIO(), io.StringIO()], [[], []]

    def attempt(n: int):
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: logged[n].append(record.getMessage())
        project = logging.getLogger("raytrain_hymt")
        level = project.level
        project.setLevel(logging.INFO)  # as hymt's console shows it (pytest's root logger is at WARNING)
        project.addHandler(handler)
        try:
            with contextlib.redirect_stdout(printed[n]), contextlib.redirect_stderr(printed[n]):
                return run_search(load_config("tune-tiny-cpu", overrides))
        finally:
            project.removeHandler(handler)
            project.setLevel(level)
            sys.stdout.write(printed[n].getvalue())

    # First attempt: interrupted once the second trial started (one at a time: the first has finished).
    watcher = _interrupt_when(storage / "lr-search", "trial-*/run.json", 2)
    first = attempt(0)
    watcher.join(timeout=5)
    # Second attempt: the same command continues the search.
    second = attempt(1)
    print(f"search: interrupted + continued in {time.monotonic() - started:.0f} s")
    CONSOLE.update(printed=[p.getvalue() for p in printed], logged=logged)
    return storage, first, second


#: What the ``search`` fixture's two attempts printed and logged (``printed``, ``logged``: one entry each).
CONSOLE: dict = {}


def test_the_search_console_is_one_line_per_trial(search):
    """Tune's own console is off (no status table every 30 s, no trial configs or results, no experiment
    header or TensorBoard hint): one line per trial that ended, from the trial's final result, then the
    result table with the best trial (``SearchResult.lines``)."""
    _, first, second = search
    assert [ln for text in CONSOLE["printed"] for ln in text.splitlines()
            if re.search(r"Trial|[Tt]ensor[Bb]oard|View detailed results|Configuration for experiment|[╭│╰]", ln)] == []
    assert [ln for logs in CONSOLE["logged"] for ln in logs if "metric(s) to send" in ln] == []
    ended = [[ln for ln in logs if ln.startswith("trial ")] for logs in CONSOLE["logged"]]
    done_before, interrupted = first.rows
    # The interrupted trial gets no line there: the second attempt ran it again to its end.
    assert ended[0] == [f"trial {done_before.trial_id} {trial_line(done_before.params, done_before.val_loss, 8, 8)}"]
    rows = {r.trial_id: r for r in second.rows}
    assert sorted(ended[1]) == sorted(f"trial {r.trial_id} {trial_line(r.params, r.val_loss, r.steps, 8)}"
                                      for r in second.rows if r.trial_id != done_before.trial_id)
    hopeless = next(r for r in second.rows if r.stopped_early)
    assert f"trial {hopeless.trial_id} stopped: optim.lr=1e-06, val_loss {hopeless.val_loss:.4f} after 2 of 8 steps" \
        in ended[1]
    assert rows[interrupted.trial_id].status == "done"
    assert any(ln.startswith(f"  best trial:   {second.best.trial_id} (optim.lr=") for ln in second.lines())


def test_trial_lines_name_the_params_the_loss_and_the_steps():
    assert trial_line({"optim.lr": 1e-3}, 6.12345, 8, 8) == "done: optim.lr=0.001, val_loss 6.1235 after 8 steps"
    assert trial_line({"optim.lr": 1e-6, "lora.rank": 8}, None, 0, 8) == (
        "stopped: optim.lr=1e-06, lora.rank=8, val_loss - after 0 of 8 steps")


def test_a_cluster_without_the_state_api_is_refused_and_a_local_ray_has_it(tmp_path):
    """The check ``hymt tune`` runs before any trial, on a Ray without its dashboard, then on the local Ray
    the product starts (``session.init_ray``): refused with the fix, then passed (both in a subprocess, a
    Ray of its own beside the session's)."""
    script = """
import ray
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.driver.session import check_state_api
from raytrain_hymt.driver.session import init_ray
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
try:
    check_state_api()
except ConfigError as e:
    print("REFUSED:", e)
ray.shutdown()
init_ray(load_config(None, []))
check_state_api()
print("LOCAL RAY: ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    # ServerUnavailable alone; beside the session's cluster, whose dashboard has port 8265, that one answers.
    assert ("REFUSED: hymt tune needs Ray's State API, served by the dashboard, which this cluster does not run "
            "(ServerUnavailable)" in out.stdout) or ("which this cluster does not run (the State API on this machine "
                                                    "answers for another Ray cluster)" in out.stdout), out.stdout
    assert "Start the cluster with the dashboard" in out.stdout and out.stdout.rstrip().endswith("LOCAL RAY: ok")


def test_a_stale_ray_address_file_does_not_mislead_ray_trains_cleaner():
    """A machine where a `ray start` cluster died without `ray stop` keeps its address in
    ``<tmp>/ray/ray_current_cluster``. Ray Train's placement-group cleaner asks the State API without an
    address, so Ray would take that one (40 s GCS timeouts: each fit waited 12 s at its end and stopped
    trials kept their workers). In the local Ray the product starts, the cleaner's question, asked from a
    worker as the cleaner asks it, is answered by that cluster's own dashboard. A subprocess with its own
    temp dir stands in for such a machine."""
    temp = tempfile.mkdtemp(prefix="hymt-stale-", dir="/tmp")  # short: Ray's socket paths have a length limit
    Path(temp, "ray").mkdir()
    Path(temp, "ray", "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")  # nothing listens there
    script = """
import os, time, ray
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.driver.session import init_ray
init_ray(load_config(None, []))
print("DRIVER ENV:", os.environ.get("RAY_API_SERVER_ADDRESS"))

@ray.remote(num_cpus=0)
def ask_like_the_cleaner(actor_id):
    from ray.train.v2._internal.state.util import is_actor_alive
    started = time.monotonic()
    return is_actor_alive(actor_id=actor_id, timeout=10), time.monotonic() - started

@ray.remote(num_cpus=0)
class Controller:
    pass

controller = Controller.remote()
ray.get(controller.__ray_ready__.remote())
alive, seconds = ray.get(ask_like_the_cleaner.remote(controller._actor_id.hex()))
print("ALIVE:", alive, "IN", round(seconds, 1))
"""
    env = dict(os.environ, RAY_TMPDIR=temp)
    env.pop("RAY_ADDRESS", None)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "DRIVER ENV: None" in out.stdout, out.stdout  # the driver's own environment is left as it was
    alive, seconds = out.stdout.split("ALIVE: ")[1].split(" IN ")
    assert alive == "True" and float(seconds) < 5, out.stdout


def test_interrupted_search_continues(search):
    _, first, second = search
    # One at a time: the first trial had finished, the second was running (Tune had not made the rest).
    assert not first.finished
    assert [r.status for r in first.rows] == ["done", "unfinished"]
    assert second.finished and second.name == first.name
    assert second.mlflow_run_id == first.mlflow_run_id  # the same parent run, continued
    after = {r.trial_id: r for r in second.rows}
    done_before, interrupted = first.rows
    assert after[done_before.trial_id].val_loss == done_before.val_loss  # not run again
    # The interrupted trial ran again to the end, into its own MLflow run (checked below: no step twice).
    assert (after[interrupted.trial_id].status, after[interrupted.trial_id].steps) == ("done", 8)
    assert after[interrupted.trial_id].mlflow_run_id == interrupted.mlflow_run_id
    assert "INTERRUPTED" in first.lines()[0] and "finished" in second.lines()[0]


def test_asha_stops_the_hopeless_trial_and_the_best_lr_wins(search):
    _, _, result = search
    rows = {r.params["optim.lr"]: r for r in result.rows}
    assert sorted(rows) == sorted(SEARCH_LRS)
    hopeless = rows[1e-6]
    assert hopeless.stopped_early and hopeless.status == "stopped" and hopeless.steps == 2
    # Stopping means its training really ended (the trial's TorchTrainer went down with it).
    logged = [json.loads(line) for line in Path(hopeless.run_dir, "metrics.jsonl").read_text().splitlines()]
    assert max(e["step"] for e in logged if e["key"] == "train/loss") < 8
    done = [r for r in result.rows if r.status == "done"]
    assert done and all(r.steps == 8 for r in done)
    assert result.best.params["optim.lr"] == min(done, key=lambda r: r.val_loss).params["optim.lr"]
    assert result.best.val_loss < hopeless.val_loss
    # The best checkpoint is the trial's final one, inside the search folder.
    assert Path(result.best.checkpoint).name == "checkpoint_step00000008"
    assert Path(result.best.checkpoint).parent == Path(result.search_dir) / f"trial-{result.best.trial_id}"
    # The table is printed with every trial, best first.
    text = "\n".join(result.lines())
    assert f"best trial:   {result.best.trial_id}" in text
    assert text.index(result.best.trial_id) < text.index(hopeless.trial_id)


def test_best_preset_trains_with_the_best_lr(search):
    _, _, result = search
    cfg = load_config(result.best_preset)
    assert cfg.optim.lr == result.best.params["optim.lr"]
    assert cfg.optim.max_steps == 8 and cfg.tune is None
    assert yaml.safe_load(Path(result.best_preset).read_text())["scaling"]["num_workers"] == 1


def test_mlflow_parent_has_one_child_per_trial(search):
    from mlflow import MlflowClient

    storage, _, result = search
    assert result.tracking_uri == f"sqlite:///{storage}/mlflow.db"
    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.mlflow_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["best.optim.lr"] == str(result.best.params["optim.lr"])
    assert parent.data.metrics["best/val_loss"] == pytest.approx(result.best.val_loss)
    artifacts = {a.path for a in client.list_artifacts(result.mlflow_run_id)}
    assert {"config.yaml", "trials.txt", "trials.csv", BEST_PRESET} <= artifacts
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{result.mlflow_run_id}'")
    assert len(children) == len(SEARCH_LRS)  # no duplicate for the trial that was interrupted and continued
    by_id = {c.info.run_id: c for c in children}
    for row in result.rows:
        child = by_id[row.mlflow_run_id]
        assert child.data.params["optim.lr"] == str(row.params["optim.lr"])
        assert child.data.tags[STOPPED_EARLY_TAG] == str(row.stopped_early).lower()
        assert child.info.status == ("KILLED" if row.stopped_early else "FINISHED")
        # Every step once, none twice (a stopped trial may log a step or two past its last report).
        steps = sorted(m.step for m in client.get_metric_history(row.mlflow_run_id, "train/loss"))
        assert steps == list(range(1, max(steps) + 1)) and max(steps) >= row.steps, (row, steps)
        val_steps = sorted(m.step for m in client.get_metric_history(row.mlflow_run_id, "val/loss"))
        assert val_steps == list(range(2, max(val_steps) + 1, 2)) and max(val_steps) >= row.steps
        if row.status == "done":
            assert max(steps) == max(val_steps) == 8
