"""A finished run submitted again: refused when it would train something else, continued with a larger
``optim.max_steps``; and ``model.init_from``'s checks, all before Ray starts. The run folders here are
written by hand, as a finished run leaves them (``config.yaml``, ``summary.json``, checkpoint folders whose
state and markers are real but whose one shard is a stand-in file: these checks read only the listing,
``state.json`` and the markers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_hymt.driver.resume import Difference, check_finished, keep_first_config
from raytrain_hymt.driver.runs import finished_summary, resolve_init_from
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.storage import CHANGES_FILE, SUMMARY_FILE
from raytrain_hymt.train.checkpoint import base_identity
from run_folders import finished_run as _finished, run_config as _cfg, whole_checkpoint as _checkpoint

MAX_STEPS = Difference("optim.max_steps", 20, 80, True)
LR = Difference("optim.lr", 0.002, 0.001, True)


def test_more_steps_continue_a_finished_run_and_are_no_trajectory_change():
    continues, diffs = check_finished([MAX_STEPS], 20, "e2e", allow=False)
    assert continues
    assert diffs == [Difference("optim.max_steps", 20, 80, False)]
    # From epochs (no max_steps) to a step count past the steps trained: continues as well.
    assert check_finished([Difference("optim.max_steps", None, 21, True)], 20, "e2e", allow=False)[0]


def test_a_changed_trajectory_field_of_a_finished_run_is_refused_naming_it_even_with_more_steps():
    with pytest.raises(ConfigError) as caught:
        check_finished([MAX_STEPS, LR], 20, "e2e", allow=False)
    assert str(caught.value) == (
        "run 'e2e' started with another config; resuming it with this one would change what it trains (1 field):\n"
        "  optim.lr: 0.002 -> 0.001\n"
        "Resume anyway with --set run.allow_config_change=true (the change is recorded in config-changes.jsonl), "
        "or start a new run from its weights with another --name and --set model.init_from=e2e.")


def test_an_allowed_change_continues_only_with_more_steps():
    continues, diffs = check_finished([MAX_STEPS, LR], 20, "e2e", allow=True)
    assert continues and [d.trajectory for d in diffs] == [False, True]
    with pytest.raises(ConfigError) as caught:
        check_finished([LR], 20, "e2e", allow=True)
    assert str(caught.value) == (
        "run 'e2e' finished at step 20: changing optim.lr trains nothing; continue it with --set optim.max_steps=N "
        "(N > 20), or start a new run from its weights with --set model.init_from=e2e")


@pytest.mark.parametrize("steps", [10, 20])
def test_max_steps_not_above_the_steps_trained_is_one_line(steps):
    with pytest.raises(ConfigError) as caught:
        check_finished([Difference("optim.max_steps", 30, steps, True)], 20, "e2e", allow=True)
    assert str(caught.value) == (f"run 'e2e' finished at step 20: optim.max_steps={steps} trains nothing more; "
                                 "continue it with an optim.max_steps larger than 20")


def test_free_changes_of_a_finished_run_print_its_summary():
    assert check_finished([Difference("eval.every_steps", 10, 5, False)], 20, "e2e", allow=False) == (
        False, [Difference("eval.every_steps", 10, 5, False)])


def test_a_finished_run_goes_on_with_more_steps_and_is_unfinished_until_it_ends(tmp_path):
    folder = _finished(tmp_path)
    same = _cfg(tmp_path, name="e2e")
    assert finished_summary(same).steps == 20  # nothing changed: its summary
    more = _cfg(tmp_path, "optim.max_steps=80", name="e2e")
    assert finished_summary(more) is None  # it continues
    keep_first_config(folder, more)
    # Gone until the continuation ends: one cut short is resumed, not reported finished at step 20.
    assert folder.read_text(SUMMARY_FILE) is None
    change = json.loads(folder.read_text(CHANGES_FILE))
    assert [(c["field"], c["before"], c["after"], c["trajectory"]) for c in change["changes"]] == [
        ("optim.max_steps", 20, 80, False)]
    keep_first_config(folder, more)  # its resubmission resumes with no new difference
    assert len(folder.read_text(CHANGES_FILE).splitlines()) == 1


def test_a_finished_run_with_a_changed_lr_stops_before_anything_is_written(tmp_path):
    folder = _finished(tmp_path)
    changed = _cfg(tmp_path, "optim.max_steps=80", "optim.lr=1e-3", name="e2e")
    for check in (finished_summary, lambda cfg: keep_first_config(folder, cfg)):
        with pytest.raises(ConfigError, match=r"\n  optim.lr: 0.002 -> 0.001\n"):
            check(changed)
    assert folder.read_text(SUMMARY_FILE) is not None and folder.read_text(CHANGES_FILE) is None


def _init_from(storage: Path, value: str, *sets: str) -> str:
    cfg = _cfg(storage, f"model.init_from={value}", *sets)
    resolve_init_from(cfg)
    return cfg.model.init_from


def test_init_from_resolves_to_the_newest_whole_checkpoint_or_the_named_one(tmp_path):
    _finished(tmp_path)
    run = tmp_path / "e2e"
    _checkpoint(run, 10)
    newest = _checkpoint(run, 20)
    (_checkpoint(run, 30) / "complete" / "rank1").unlink()  # cut off: skipped
    assert _init_from(tmp_path, "e2e") == str(newest)
    assert _init_from(tmp_path, str(run)) == str(newest)  # a run folder's path
    assert _init_from(tmp_path, "e2e/checkpoint_step00000010") == str(run / "checkpoint_step00000010")
    assert _init_from(tmp_path, str(newest)) == str(newest)  # a resolved value resolves to itself


def _refusal(storage: Path, value: str, *sets: str) -> str:
    with pytest.raises(ConfigError) as caught:
        _init_from(storage, value, *sets)
    return str(caught.value)


def test_init_from_refusals_name_what_is_wrong(tmp_path):
    run = tmp_path / "e2e"
    _finished(tmp_path)
    assert _refusal(tmp_path, "nope") == (
        f"model.init_from 'nope': no run folder {tmp_path}/nope (no run 'nope' under run.storage_root)")
    assert _refusal(tmp_path, "e2e") == (
        f"model.init_from 'e2e': {run} has no whole checkpoint (no checkpoint_step* folder with every rank's part)")
    _checkpoint(run, 20)
    assert _refusal(tmp_path, "e2e/checkpoint_step00000007") == (
        f"model.init_from 'e2e/checkpoint_step00000007': {run}/checkpoint_step00000007: no such folder "
        "(a checkpoint is a run's checkpoint_step* folder)")
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    assert _refusal(tmp_path, str(run / "model")) == (
        f"model.init_from '{run}/model': {run}/model is an exported model folder, not a run; start from it with "
        f"--set model.name_or_path={run}/model instead")
    with pytest.raises(ConfigError, match="^model.init_from 'e2e' is this run itself; submit it again without "):
        resolve_init_from(_cfg(tmp_path, "model.init_from=e2e", name="e2e"))
    assert _refusal(tmp_path, "e2e", f"model.name_or_path={tmp_path}") == (
        f"model.init_from 'e2e': that run trained model.name_or_path 'tiny', this one is '{tmp_path}'; its weights "
        "fit only that model")
    assert _refusal(tmp_path, "e2e", "lora.enabled=true") == (
        "model.init_from 'e2e': that run trained the full model, this one trains LoRA adapters (lora.enabled); "
        f"start from its exported model instead: --set model.name_or_path={run}/model")


def test_init_from_a_lora_run_needs_the_same_adapters_and_base(tmp_path):
    run = tmp_path / "lora"
    _finished(tmp_path, "lora", 20, "lora.enabled=true")
    _checkpoint(run, 20, base_model=base_identity("tiny", 0))
    assert _init_from(tmp_path, "lora", "lora.enabled=true") == str(run / "checkpoint_step00000020")
    assert _refusal(tmp_path, "lora") == (
        "model.init_from 'lora': that run trained LoRA adapters, this one trains the full model (lora.enabled); "
        f"start from its exported model instead: --set model.name_or_path={run}/model")
    assert _refusal(tmp_path, "lora", "lora.enabled=true", "lora.rank=8") == (
        "model.init_from 'lora': its adapters have lora.rank 16, this run 8")
    assert _refusal(tmp_path, "lora", "lora.enabled=true", "run.seed=1").startswith(
        "model.init_from 'lora': the LoRA adapters were trained on base 'tiny', but the base is now 'tiny' and "
        "differs in seed.")
