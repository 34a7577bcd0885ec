"""Users' mistakes: each one is caught early, said in one clear message, and loses nothing.

Most tests call the command line in-process (``cli.main``: the exit status and stderr the user sees)
and fail before Ray starts. The subprocess tests prove it from outside: their own HOME/TMPDIR, no
RAY_ADDRESS, so a Ray session folder would appear there. Only Ctrl-C needs a real run (a few tiny steps
on the session's Ray).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pyarrow.fs
import pytest
import torch
import yaml

from conftest import REPO, tiny_overrides
from raytrain_hymt import cli
from raytrain_hymt.train.checkpoint import IncompleteCheckpointError, check_checkpoint, unreadable_file
from raytrain_hymt.config.schema import Config, flatten, load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.data.cleaning import DataQualityError
from raytrain_hymt.data.preflight import check_inputs, model_problem, nearest_language, source_problems, trained_directions
from raytrain_hymt.data.readers import read_line_tables, tatoeba_parser
from raytrain_hymt.data.files import file_name
from raytrain_hymt.errors import describe_failure
from raytrain_hymt.storage import CHANGES_FILE
from raytrain_hymt.driver.resume import (TRAJECTORY_FREE, changes_trajectory, check_resume, enforce,
                                  keep_first_config)
from raytrain_hymt.storage import RunFolder

HUNYUAN_CODES = ("Hunyuan-MT's codes: zh, en, fr, pt, es, ja, tr, ru, ar, ko, th, it, de, vi, ms, id, tl, hi, "
                 "zh-Hant, pl, cs, nl, km, my, fa, gu, ur, te, mr, he, bn, ta, uk, bo, kk, mn, ug, yue")


def sources(*items: dict) -> str:
    """A ``--set data.sources=[...]`` override."""
    return "data.sources=" + json.dumps(list(items))


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """``hymt ARGV`` in this process: (exit status, stderr)."""
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A 2-column TSV de-en corpus (3 lines)."""
    path = tmp_path / "de-en.tsv"
    path.write_text("Hallo\tHello\nDanke\tThank you\nJa\tYes\n", encoding="utf-8")
    return path


# ---- language codes -------------------------------------------------------------------------------

@pytest.mark.parametrize("typo, code", [("jp", "ja"), ("cn", "zh"), ("kr", "ko"), ("cz", "cs"), ("ua", "uk"),
                                        ("Japanese", "ja"), ("englsh", "en"), ("German", "de"), ("frnch", "fr")])
def test_a_mistyped_language_gets_the_nearest_valid_code(typo, code):
    assert nearest_language(typo) == code


def test_codes_that_name_no_hunyuan_language_get_no_false_suggestion():
    # Edit distance alone would say "bn" for "cn" and something for "gr"; Greek is simply not supported.
    assert nearest_language("xx") is None
    assert nearest_language("gr") is None
    # Aliases the model knows are not mistakes at all: ISO 639-2/3, BCP-47 regions, deprecated iw.
    for label in ("jpn", "deu", "zh-CN", "zh-TW", "iw", "cmn_Hans"):
        assert nearest_language(label) is not None


def test_a_language_typo_stops_before_ray_and_names_field_file_and_fix(capsys, corpus, tmp_path):
    code, err = run_cli(capsys, "prepare", str(tmp_path / "out"),
                        "--set", sources({"path": str(corpus), "format": "tsv", "src_lang": "de", "tgt_lang": "jp"}))
    assert code == 2
    assert err == (f"error: data.sources[0].tgt_lang: 'jp' is not a Hunyuan-MT language (source '{corpus}'); "
                   "did you mean 'ja' (Japanese)?\n")
    assert not (tmp_path / "out").exists()


def test_an_unknown_code_is_named_even_for_moses(tmp_path):
    (tmp_path / "c.de").write_text("Hallo\n")
    (tmp_path / "c.en").write_text("Hello\n")
    cfg = load_config(None, [sources({"path": str(tmp_path / "c"), "format": "moses", "src_lang": "de",
                                      "tgt_lang": "xx"})])
    # Not "missing partner corpus.xx": the code is the mistake.
    assert source_problems(cfg.data) == [
        f"data.sources[0].tgt_lang: 'xx' is not a Hunyuan-MT language (source '{tmp_path / 'c'}'); {HUNYUAN_CODES}"]


def test_source_and_target_in_one_language_is_refused(corpus):
    cfg = load_config(None, [sources({"path": str(corpus), "format": "tsv", "src_lang": "en", "tgt_lang": "eng"})])
    assert source_problems(cfg.data) == [
        "data.sources[0]: src_lang 'en' and tgt_lang 'eng' are the same language (en); a pair needs two languages"]


# ---- files and formats ----------------------------------------------------------------------------

def test_missing_files_and_wrong_formats_are_listed_one_line_each(tmp_path, corpus):
    tatoeba = tmp_path / "t.tsv"
    tatoeba.write_text("eng\tdeu\tHi\tHallo\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"de": "Hallo", "en": "Hello"}\n')
    cfg = load_config(None, [sources(
        {"path": str(tmp_path / "missing*.tsv"), "format": "tsv", "src_lang": "de", "tgt_lang": "en"},
        {"path": str(corpus), "format": "tatoeba"},
        {"path": str(tatoeba), "format": "tsv", "src_lang": "en", "tgt_lang": "de"},
        {"path": str(jsonl), "format": "jsonl", "src_lang": "de", "tgt_lang": "en"},
    )])
    assert source_problems(cfg.data) == [
        f"data.sources[0].path: data source '{tmp_path}/missing*.tsv': no such file (or the glob matched nothing)",
        f"data.sources[1].format: {corpus}: its first 3 lines have 2 tab-separated columns, format 'tatoeba' "
        "needs 4 (format 'tsv' reads 2 columns: src, tgt)",
        f"data.sources[2].format: {tatoeba}: line 1 has 4 tab-separated columns, format 'tsv' needs 2 "
        "(format 'tatoeba' reads 4 columns: src_lang, tgt_lang, src, tgt)",
        f"data.sources[3].format: {jsonl}: line 1 has no field 'src', 'tgt' (fields: de, en); set src_column/tgt_column",
    ]
    with pytest.raises(ConfigError, match=r"^4 problems in the data sources and model:\n  data.sources\[0\]"):
        check_inputs(cfg)


def test_empty_and_unreadable_files_are_named(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n\n")
    locked = tmp_path / "locked.tsv"
    locked.write_text("a\tb\n")
    locked.chmod(0)
    cfg = load_config(None, [sources(*({"path": str(p), "format": "tsv", "src_lang": "de", "tgt_lang": "en"}
                                       for p in (empty, locked)))])
    problems = source_problems(cfg.data)
    assert problems[0] == f"data.sources[0].path: {empty} is empty (no lines with text)"
    if os.geteuid() != 0:  # root reads any file
        assert problems[1] == f"data.sources[1].path: cannot read {locked}: Permission denied"


def test_moses_partners_must_exist_and_have_as_many_lines(tmp_path):
    (tmp_path / "a.de").write_text("eins\nzwei\n")
    (tmp_path / "a.en").write_text("one\n")
    (tmp_path / "b.de").write_text("drei\n")
    cfg = load_config(None, [sources(*({"path": str(tmp_path / p), "format": "moses", "src_lang": "de",
                                        "tgt_lang": "en"} for p in ("a", "b")))])
    assert source_problems(cfg.data) == [
        f"data.sources[0].path: Moses files are not line-aligned: {tmp_path}/a.de has 2 lines, {tmp_path}/a.en has 1",
        f"data.sources[1].path: Moses source '{tmp_path}/b': {tmp_path}/b.de has no partner {tmp_path}/b.en",
    ]


def test_a_utf8_bom_is_not_part_of_the_first_language_label(tmp_path):
    path = tmp_path / "bom.tsv"
    path.write_bytes("\ufeffeng\tdeu\tHi\tHallo\n".encode("utf-8"))
    (table,) = read_line_tables(str(path), 0, tatoeba_parser(None, None), file_name(str(path), str(tmp_path)))
    assert table.column("src_lang").to_pylist() == ["eng"]
    assert table.column("src").to_pylist() == ["Hi"]


def test_preflight_failure_creates_no_ray_session_run_folder_or_mlflow_run(tmp_path, corpus):
    """From outside: RAY_ADDRESS unset, HOME and TMPDIR in tmp_path, so Ray would start its own session there."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.update(HOME=str(home), TMPDIR=str(home), RAY_TMPDIR=str(home),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    runs = tmp_path / "runs"
    bad = sources({"path": str(corpus), "format": "tsv", "src_lang": "de", "tgt_lang": "jp"})
    run = subprocess.run([sys.executable, "-m", "raytrain_hymt.cli", "prepare", str(tmp_path / "out"), "--set", bad,
                          "--set", f"run.storage_root={runs}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.startswith("error: data.sources[0].tgt_lang: 'jp' is not a Hunyuan-MT language")
    assert "Traceback" not in run.stderr
    assert not list(home.rglob("session_*")), list(home.rglob("*"))
    assert not (tmp_path / "out").exists()
    assert not runs.exists()  # no run folder, no mlflow.db


def test_train_with_a_bad_source_leaves_no_run_folder_or_mlflow_store(capsys, tmp_path, corpus):
    bad = sources({"path": str(corpus), "format": "tsv", "src_lang": "de", "tgt_lang": "de"})
    code, err = run_cli(capsys, "train", "--name", "r", "--set", bad, "--set", f"run.storage_root={tmp_path}/runs")
    assert code == 2
    assert err == ("error: data.sources[0]: src_lang 'de' and tgt_lang 'de' are the same language (de); "
                   "a pair needs two languages\n")
    assert not (tmp_path / "runs").exists()


# ---- models ---------------------------------------------------------------------------------------

def test_a_model_path_that_does_not_exist_is_one_line_before_ray(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "--set", "model.name_or_path=/nope", "--set", f"run.storage_root={tmp_path}")
    assert code == 2
    assert err == ("error: model.name_or_path: no such folder '/nope' (looked for a local model folder; a hub id "
                   "is written org/name, e.g. tencent/Hunyuan-MT-7B)\n")
    code, err = run_cli(capsys, "evaluate", "--model", "/nope", "--test-set", str(tmp_path),
                        "--set", f"run.storage_root={tmp_path}")
    assert code == 2
    assert err.startswith("error: --model: no such folder '/nope' (looked for a local model folder")
    assert list(tmp_path.iterdir()) == []


def test_a_hub_id_offline_must_be_in_the_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache stands in for a new machine
    assert model_problem("model.name_or_path", "org/nope") == (
        f"model.name_or_path: 'org/nope' is not in the Hugging Face cache ({tmp_path}) and HF_HUB_OFFLINE=1 forbids "
        "the download (looked for a hub model org/name; a local folder starts with / . or ~)")


def test_a_folder_that_is_no_model_and_hub_ids(tmp_path):
    assert model_problem("model.name_or_path", str(tmp_path)) == (
        f"model.name_or_path: '{tmp_path}' is a folder but not a Hugging Face model folder (no config.json)")
    assert model_problem("model.name_or_path", "tencent/Hunyuan-MT-7B") is None  # checked where it loads
    assert model_problem("model.name_or_path", "tiny") is None


# ---- errors read as one message -------------------------------------------------------------------

def test_multi_line_errors_are_shown_whole():
    err = DataQualityError("44 of 2000 rows are bad (2.20%), above the limit of 1.00% (data.max_bad_fraction). "
                           "Check the file format and encoding, or raise the limit. Examples:\n  a.tsv:3: malformed")
    assert describe_failure(err) == f"DataQualityError: {err}"
    assert "\n  a.tsv:3: malformed" in describe_failure(err)


def test_an_empty_error_text_never_reaches_the_user():
    assert describe_failure(RuntimeError("")) == (
        "RuntimeError: (the error carried no message; HYMT_VERBOSE=1 shows where it was raised)")


def test_an_empty_marker_cause_is_not_the_message():
    """Ray Data raises an actor's init error "from SystemException()" (seen with a broken tokenizer folder)."""
    from ray.data.exceptions import SystemException

    try:
        try:
            raise ValueError('  File "tokenize.py", line 110, in __init__\njson.decoder.JSONDecodeError: Expecting value')
        except ValueError as e:
            raise e from SystemException()
    except ValueError as e:
        assert describe_failure(e) == "ValueError: json.decoder.JSONDecodeError: Expecting value"


def test_a_remote_traceback_in_the_text_is_cut_to_the_original_line():
    text = 'ray::read() (pid=1)\n  File "x.py", line 3, in f\n    raise ValueError("bad row")\nValueError: bad row'
    assert describe_failure(RuntimeError(text)) == "RuntimeError: ValueError: bad row"


@pytest.mark.integration
def test_too_many_bad_rows_through_ray_reach_the_user_whole(capsys, ray_session, tmp_path):
    path = tmp_path / "bad.tsv"
    good = "".join(f"Satz {i}\tSentence {i}\n" for i in range(1956))
    path.write_text(good + "".join(f"kaputt {i}\n" for i in range(44)))
    code, err = run_cli(capsys, "prepare", str(tmp_path / "out"),
                        "--set", sources({"path": str(path), "format": "tsv", "src_lang": "de", "tgt_lang": "en"}))
    assert code == 1
    assert ("error: DataQualityError: 44 of 2000 rows are bad (2.20%), above the limit of 1.00% "
            "(data.max_bad_fraction). Check the file format and encoding, or raise the limit. Examples:\n"
            f"  {path}:") in err
    assert err.count(": malformed: ") == 5  # five sample lines, each on its own line


def test_ctrl_c_outside_training_is_one_line_without_traceback(capsys, monkeypatch, tmp_path):
    import raytrain_hymt.driver.train as prepare

    def interrupted(cfg, out, **_options):  # stands in for the user pressing Ctrl-C while the data is prepared
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "prepare_dataset", interrupted)
    code, err = run_cli(capsys, "prepare", str(tmp_path / "out"))
    assert code == 130
    assert err == f"interrupted; run again with: hymt prepare {tmp_path}/out\n"


# ---- run names, --set, help -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, shown", [(["--name", "../x"], "--name '../x'"),
                                         (["--set", "run.name=/abs"], "run.name '/abs'")])
def test_run_names_are_one_folder_name(capsys, tmp_path, argv, shown):
    code, err = run_cli(capsys, "train", *argv, "--set", f"run.storage_root={tmp_path}/runs")
    assert code == 2
    assert (f"{shown} is not a run name: a run is the folder <run.storage_root>/<name>, so the name is one folder "
            "name (no '/', not '.' or '..'); to store runs elsewhere set run.storage_root") in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


def test_a_set_error_names_the_set_not_the_preset():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.lr=abc"])
    assert str(e.value) == ("invalid configuration:\n  optim.lr: Input should be a valid number, unable to parse "
                            "string as a number (got 'abc', from --set optim.lr=abc)")


def test_a_preset_error_names_the_preset(tmp_path):
    preset = tmp_path / "mine.yaml"
    preset.write_text("optim:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=rf"optim.lr: Input should be greater than 0 \(got -1, from {preset}\)"):
        load_config(str(preset))


def test_name_help_says_what_name_does_on_each_command():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    helps = {cmd: next(a.help for a in subparsers[cmd]._actions if a.dest == "name")
             for cmd in ("train", "prepare", "evaluate", "tune")}
    assert "resumes" in helps["train"]
    assert "resume" not in helps["prepare"] and "resume" not in helps["evaluate"]
    assert helps["evaluate"].startswith("the finished run to score")


# ---- evaluation directions ------------------------------------------------------------------------

def test_evaluation_defaults_to_the_runs_trained_directions(corpus):
    cfg = load_config(None, [sources({"path": str(corpus), "format": "tsv", "src_lang": "de", "tgt_lang": "en"}),
                             "data.both_directions=true"])
    assert trained_directions(cfg.data) == ["de-en", "en-de"]
    assert trained_directions(load_config(None).data) == ["en-zh"]  # the bundled Tatoeba sample's rows
    args = cli.build_parser().parse_args(["evaluate", "--name", "r"])
    cli._default_to_trained_directions(cfg, args)
    assert cfg.eval.directions == ["de-en", "en-de"]
    chosen = load_config(None, ["eval.directions=[en-zh]"])
    cli._default_to_trained_directions(chosen, args)  # a run that chose its directions keeps them
    assert chosen.eval.directions == ["en-zh"]


# ---- checkpoints ----------------------------------------------------------------------------------

def test_a_folder_that_is_not_a_checkpoint_is_called_so(tmp_path):
    fs = pyarrow.fs.LocalFileSystem()
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(IncompleteCheckpointError) as e:
        check_checkpoint(fs, str(tmp_path))
    assert str(e.value) == (f"{tmp_path} is not a checkpoint: it has no state.json and no complete/ markers (a "
                            "checkpoint is a run's checkpoint_step* folder, e.g. "
                            "<run.storage_root>/<name>/checkpoint_step00000020)")
    with pytest.raises(IncompleteCheckpointError, match="no such folder"):
        check_checkpoint(fs, str(tmp_path / "nope"))
    (tmp_path / "complete").mkdir()
    (tmp_path / "complete" / "rank1").write_text("{}")
    with pytest.raises(IncompleteCheckpointError, match="no state.json \\(rank 0 did not finish writing\\)"):
        check_checkpoint(fs, str(tmp_path))


def test_a_damaged_shard_of_the_right_size_is_named(tmp_path):
    tag = tmp_path / "step00000002"
    tag.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        torch.save({"w": torch.zeros(4)}, tag / name)
    shard = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, other content
    with pytest.raises(Exception) as load_error:  # noqa: PT011 - whatever torch says about zeros
        torch.load(shard, weights_only=False)
    text = unreadable_file(pyarrow.fs.LocalFileSystem(), str(tmp_path), load_error.value)
    assert text == (f"{shard} is damaged: it has the size its rank wrote but is not a readable PyTorch file "
                    f"({type(load_error.value).__name__}: {load_error.value})")
    assert zipfile.is_zipfile(tag / "mp_rank_00_model_states.pt")


# ---- resume checks what it resumes ----------------------------------------------------------------

def test_what_may_change_on_resume_is_an_explicit_list():
    fields = flatten(Config().model_dump(mode="json"))
    # Every optimizer, schedule, batch and LoRA field decides the trajectory; so does any field not listed.
    assert all(changes_trajectory(f) for f in fields if f.startswith(("optim.", "lora.")))
    assert all(not changes_trajectory(f) for f in fields if f.startswith(("tracking.", "eval.")))
    assert all(any(f == free.rstrip(".") or f.startswith(free) for f in fields) for free in TRAJECTORY_FREE)
    assert not changes_trajectory("tune")  # unset: one None value
    for field in ("data.sources", "data.seed", "model.name_or_path", "optim.lr", "optim.max_steps",
                  "optim.schedule", "optim.micro_batch_size", "optim.grad_accum", "optim.global_batch_rows",
                  "deepspeed.zero_stage", "deepspeed.precision", "lora.rank", "run.seed", "data.pack_tokens"):
        assert changes_trajectory(field), field
    for field in ("tracking.log_every_steps", "eval.every_steps", "checkpoint.max_failures", "tracking.experiment",
                  "scaling.num_workers"):
        assert not changes_trajectory(field), field


def test_another_worker_count_resumes_only_with_the_same_global_batch():
    """A run may continue on another worker count as long as its global batch stays: fixed by
    optim.global_batch_rows, or by a micro-batch × accumulation that makes up for the new count."""
    saved = load_config(None, ["optim.global_batch_rows=4"]).model_dump(mode="json")
    fewer = load_config(None, ["optim.global_batch_rows=4", "scaling.num_workers=1"]).model_dump(mode="json")
    assert [(d.field, d.trajectory) for d in check_resume(saved, fewer)] == [("scaling.num_workers", False)]
    # Without global_batch_rows, 1 worker × 1 × 2 rows is half the default job's 2 × 1 × 2.
    plain = load_config(None, ["scaling.num_workers=1"]).model_dump(mode="json")
    diffs = check_resume(load_config(None).model_dump(mode="json"), plain)
    assert [(d.field, d.before, d.after, d.trajectory) for d in diffs] == [
        ("scaling.num_workers", 2, 1, False), ("global batch (rows per optimizer step)", 4, 2, True)]
    with pytest.raises(ConfigError, match=r"global batch \(rows per optimizer step\): 4 -> 2"):
        enforce(diffs, "r", allow=False)


def test_check_resume_lists_each_differing_field():
    saved = load_config(None).model_dump(mode="json")
    new = load_config(None, ["optim.lr=3e-5", "tracking.log_every_steps=5"]).model_dump(mode="json")
    diffs = check_resume(saved, new)
    assert [(d.field, d.before, d.after, d.trajectory) for d in diffs] == [
        ("optim.lr", saved["optim"]["lr"], 3e-5, True), ("tracking.log_every_steps", 1, 5, False)]
    del saved["optim"]["epochs"]  # a config.yaml written before the field existed had its default
    assert check_resume(saved, load_config(None).model_dump(mode="json")) == []


def test_resume_with_another_corpus_and_max_steps_stops_and_keeps_the_first_config(tmp_path, corpus):
    folder = RunFolder(str(tmp_path), "r2")
    first = load_config(None, tiny_overrides(tmp_path, **{"run.name": "r2", "optim.max_steps": 10}))
    keep_first_config(folder, first)
    saved = (tmp_path / "r2" / "config.yaml").read_text()
    other = load_config(None, tiny_overrides(tmp_path, **{"run.name": "r2", "optim.max_steps": 30}) + [
        sources({"path": str(corpus), "format": "tsv", "src_lang": "de", "tgt_lang": "en"})])
    with pytest.raises(ConfigError) as e:
        keep_first_config(folder, other)
    message = str(e.value)
    assert message.startswith("run 'r2' started with another config; resuming it with this one would change what "
                              "it trains (2 fields):\n  data.sources: ")
    assert "\n  optim.max_steps: 10 -> 30\n" in message
    assert message.endswith("Resume anyway with --set run.allow_config_change=true (the change is recorded in "
                            "config-changes.jsonl), or start a new run with another --name.")
    assert (tmp_path / "r2" / "config.yaml").read_text() == saved
    assert sorted(p.name for p in (tmp_path / "r2").iterdir()) == ["config.yaml"]

    other.run.allow_config_change = True
    keep_first_config(folder, other)
    (line,) = (tmp_path / "r2" / CHANGES_FILE).read_text().splitlines()
    record = json.loads(line)
    assert record["allowed"] is True
    assert [c["field"] for c in record["changes"]] == ["data.sources", "optim.max_steps", "run.allow_config_change"]
    assert (tmp_path / "r2" / "config.yaml").read_text() == saved  # the first config is kept
    other.run.allow_config_change = False
    keep_first_config(folder, other)  # accepted once: the same config again is no new change
    assert len((tmp_path / "r2" / CHANGES_FILE).read_text().splitlines()) == 2


def test_a_logging_change_resumes_and_is_recorded(tmp_path):
    folder = RunFolder(str(tmp_path), "r")
    keep_first_config(folder, load_config(None, ["run.name=r"]))
    keep_first_config(folder, load_config(None, ["run.name=r", "tracking.log_every_steps=5", "eval.every_steps=7"]))
    record = json.loads((tmp_path / "r" / CHANGES_FILE).read_text())
    assert record["allowed"] is False
    assert [(c["field"], c["before"], c["after"]) for c in record["changes"]] == [
        ("eval.every_steps", 30, 7), ("tracking.log_every_steps", 1, 5)]


def test_a_corpus_moved_elsewhere_resumes_and_another_one_stops(tmp_path):
    """Rows are named relative to their source's root, so a path alone may change (the data fingerprint,
    checked next, compares the files' content); any other source field changes what the run trains."""
    folder = RunFolder(str(tmp_path), "m")

    def at(path: str, tgt: str = "en"):
        return load_config(None, ["run.name=m", f"data.sources=[{{path: '{path}', format: tsv, src_lang: de, tgt_lang: {tgt}}}]"])

    keep_first_config(folder, at("/old/corpus.tsv"))
    keep_first_config(folder, at("/new/corpus.tsv"))
    record = json.loads((tmp_path / "m" / CHANGES_FILE).read_text())
    assert [(c["field"], c["trajectory"]) for c in record["changes"]] == [("data.sources", False)]
    with pytest.raises(ConfigError, match=r"\(1 field\):\n  data.sources: "):
        keep_first_config(folder, at("/new/corpus.tsv", tgt="fr"))


# ---- Ctrl-C during training (a real run) ----------------------------------------------------------

@pytest.mark.integration
def test_ctrl_c_during_training_says_where_the_checkpoint_is_and_how_to_resume(ray_session, tmp_path, capsys):
    from raytrain_hymt.data.files import SAMPLE_CORPUS

    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    small = tmp_path / "small.tsv"  # a few hundred pairs: the point is the interrupt, not the data
    small.write_text("".join(SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines(keepends=True)[:600]))
    overrides = tiny_overrides(tmp_path, **{"optim.max_steps": 10_000, "checkpoint.every_steps": 2,
                                            "tracking.enabled": "false", "data.max_val_examples": 8}) + [
        sources({"path": str(small), "format": "tatoeba"})]
    argv = [sys.executable, "jobs/train.py", "--name", "c"] + [x for o in overrides for x in ("--set", o)]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list((tmp_path / "c").glob("checkpoint_step*/complete/rank1")) and proc.poll() is None:
            assert time.time() < deadline, "no checkpoint after 300 s"
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    resume = "hymt train --name c " + " ".join(shlex.join(["--set", o]) for o in overrides)
    lines = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"interrupted: the last checkpoint is {tmp_path}/c/checkpoint_step"), lines
    assert lines[0].endswith(f"; resume with: {resume}"), lines
    # Ray's own actors may print theirs (prefixed "(Actor pid=...)"); the driver prints none.
    assert not [line for line in err.splitlines() if "Traceback" in line and "pid=" not in line], err[-3000:]
    assert "KeyboardInterrupt" not in err
    assert not (tmp_path / "c" / "summary.json").exists() and not (tmp_path / "c" / "model").exists()

    # The interrupted run is re-submitted with another learning rate: refused before Ray, nothing lost.
    checkpoints = sorted(p.name for p in (tmp_path / "c").glob("checkpoint_step*"))
    saved = (tmp_path / "c" / "config.yaml").read_text()
    code, err = run_cli(capsys, "train", "--name", "c", *[x for o in overrides for x in ("--set", o)],
                        "--set", "optim.lr=1e-3")
    assert code == 2
    assert "error: run 'c' started with another config" in err and "  optim.lr: 0.002 -> 0.001" in err
    assert (tmp_path / "c" / "config.yaml").read_text() == saved
    assert sorted(p.name for p in (tmp_path / "c").glob("checkpoint_step*")) == checkpoints
    assert yaml.safe_load(saved)["optim"]["lr"] == 2e-3


# ---- language settings, through the hymt command as a user runs it -------------------------------

HYMT = Path(sys.executable).parent / "hymt"  # the console script pip installed for the package


def hymt(tmp_path: Path, *argv: str, ray_address: str | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``hymt ARGV`` in its own process. With ``ray_address`` it joins that cluster (the session's, so a
    test that gets as far as Ray starts none of its own; the user's HOME holds the cluster's token);
    without, HOME and TMPDIR are in tmp_path, so a Ray it started would show there."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    else:
        home = tmp_path / "home"
        home.mkdir(exist_ok=True)
        env.update(HOME=str(home), TMPDIR=str(home), RAY_TMPDIR=str(home))
    return subprocess.run([str(HYMT), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def assert_refused(run: subprocess.CompletedProcess, line: str) -> None:
    """The command stopped before Ray with exactly this one line (exit 2)."""
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr == f"error: {line}\n"


def flores_pairs(first: str, second: str, n: int) -> list[tuple[str, str]]:
    """The first ``n`` FLORES devtest sentences of two languages (file stems), side by side."""
    from conftest import FLORES_DEVTEST

    a = (FLORES_DEVTEST / f"{first}.devtest").read_text(encoding="utf-8").splitlines()
    b = (FLORES_DEVTEST / f"{second}.devtest").read_text(encoding="utf-8").splitlines()
    return list(zip(a[:n], b[:n]))


def test_src_and_tgt_lang_turn_tatoeba_rows_to_the_direction_asked_for(ray_session, tmp_path):
    """A Tatoeba file of eng→jpn rows (and one jpn→eng, one eng→deu) with src_lang ja, tgt_lang en: every
    example prepared is Japanese → English, the eng→deu row is dropped and counted, and the console says so."""
    from raytrain_hymt.data.prepared import read_manifest
    from raytrain_hymt.tokenizer import load_tokenizer
    import pyarrow.parquet as pq

    pairs = flores_pairs("eng_Latn", "jpn_Jpan", 40)
    rows = [f"eng\tjpn\t{en}\t{ja}" for en, ja in pairs[:-1]]
    rows.append(f"jpn\teng\t{pairs[-1][1]}\t{pairs[-1][0]}")
    rows.append("eng\tdeu\tGood morning, everybody.\tGuten Morgen zusammen.")
    corpus = tmp_path / "eng-jpn.tsv"
    corpus.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "prepared"
    run = hymt(tmp_path, "prepare", str(out), "--set", sources({"path": str(corpus), "src_lang": "ja", "tgt_lang": "en"}),
               "--set", "data.val_fraction=0", "--set", "data.max_length_ratio=100", "--set", "data.packing=false",
               ray_address=ray_session.get_runtime_context().gcs_address)
    assert run.returncode == 0, run.stderr[-3000:]
    console = run.stdout + run.stderr
    assert (f"data.sources[0] ({corpus}): rows are read as ja→en (src_lang, tgt_lang): rows labelled en→ja are "
            "swapped, rows in other languages are dropped as other_languages") in console, console[-3000:]
    data_line = next(line for line in run.stdout.splitlines() if line.startswith("data: read 41 pairs; dropped "))
    assert "other_languages 1" in data_line.split("; ")[1].removeprefix("dropped ").split(", "), data_line
    manifest = read_manifest(str(out))
    tok = load_tokenizer("tiny")
    texts = [tok.decode(ids) for f in manifest["files"]["train"]
             for ids in pq.read_table(out / f, columns=["input_ids"]).column("input_ids").to_pylist()]
    assert len(texts) == manifest["stats"]["train_examples"] > 0
    assert all("into English" in t and "into Japanese" not in t for t in texts), texts[0]
    # The answer is the English side: the Japanese sentence is the segment, the English one follows it.
    first = next(t for t in texts if pairs[0][0] in t)
    assert first.index("into English") < first.index(pairs[0][0])


def test_src_and_tgt_lang_that_contradict_the_rows_stop_in_one_line(tmp_path):
    corpus = tmp_path / "deu-eng.tsv"
    corpus.write_text("deu\teng\tHallo\tHello\ndeu\teng\tDanke\tThank you\n", encoding="utf-8")
    run = hymt(tmp_path, "prepare", str(tmp_path / "out"),
               "--set", sources({"path": str(corpus), "src_lang": "ja", "tgt_lang": "en"}))
    assert_refused(run, f"data.sources[0]: src_lang 'ja' and tgt_lang 'en' contradict the rows of {corpus}: its first "
                        "row is deu→eng and none of its first 2 rows is ja→en or en→ja (the rows carry their languages: "
                        "set src_lang/tgt_lang to the rows' own, or leave them unset)")
    assert not (tmp_path / "out").exists()


def test_a_corpus_with_swapped_columns_stops_before_ray_in_one_line(tmp_path):
    """FLORES English/Japanese with the Japanese in the src column, labelled en→ja: the identified languages
    of its first lines say so before any Ray session or output folder exists."""
    corpus = tmp_path / "corpus.tsv"
    corpus.write_text("".join(f"{ja}\t{en}\n" for en, ja in flores_pairs("eng_Latn", "jpn_Jpan", 50)), encoding="utf-8")
    run = hymt(tmp_path, "prepare", str(tmp_path / "out"),
               "--set", sources({"path": str(corpus), "format": "tsv", "src_lang": "en", "tgt_lang": "ja"}))
    assert_refused(run, f"data.sources[0]: {corpus} looks swapped: 50 of its first 50 identifiable lines have ja text "
                        "in the src column and en in the tgt column, but src_lang is en and tgt_lang is ja; swap "
                        "src_lang/tgt_lang (or the columns)")
    assert not (tmp_path / "out").exists() and not list((tmp_path / "home").glob("**/session_*"))


def test_prepared_data_and_explicit_sources_are_refused_together(tmp_path, corpus):
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    run = hymt(tmp_path, "train", "--set", f"data.prepared_path={prepared}",
               "--set", sources({"path": str(corpus), "format": "tsv", "src_lang": "de", "tgt_lang": "en"}),
               "--set", f"run.storage_root={tmp_path / 'runs'}")
    assert_refused(run, f"data.prepared_path: {prepared} is set together with data.sources; a prepared dataset "
                        "trains on the sources it was prepared from (its manifest.json), so data.sources would be "
                        "ignored: unset one of them")
    assert not (tmp_path / "runs").exists()


def test_prepared_data_with_the_presets_own_sources_is_not_a_conflict(capsys, tmp_path):
    # The default preset writes out the default source (the bundled sample): not a choice of the user's.
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    code, err = run_cli(capsys, "train", "--set", f"data.prepared_path={prepared}",
                        "--set", f"run.storage_root={tmp_path / 'runs'}")
    assert code == 2  # an empty prepared folder has no manifest: refused before Ray starts
    assert "set together with data.sources" not in err and "no manifest.json" in err, err


@pytest.mark.parametrize("label, hint", [
    ("dk", "Danish is not among Hunyuan-MT's 38 languages"),
    ("DK", "Danish is not among Hunyuan-MT's 38 languages"),
    ("dkk", None),
])
def test_an_alias_of_a_language_hunyuan_does_not_know_is_one_line(tmp_path, corpus, label, hint):
    run = hymt(tmp_path, "prepare", str(tmp_path / "out"),
               "--set", sources({"path": str(corpus), "format": "tsv", "src_lang": label, "tgt_lang": "en"}))
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.startswith(f"error: data.sources[0].src_lang: {label!r} is not a Hunyuan-MT language "
                                 f"(source '{corpus}'); "), run.stderr
    if hint:
        assert run.stderr.endswith(f"; {hint}\n")


def _known_labels() -> list[str]:
    """Every label the language tables know: codes, aliases, the model card's names, the suggestions for
    common mistakes and the languages named as unsupported, and each alias with every script subtag."""
    from raytrain_hymt import languages
    from raytrain_hymt.data import preflight

    labels = set(languages.LANGUAGES) | set(languages._BASE_ALIASES) | set(preflight._SUGGEST) | set(preflight._NOT_SUPPORTED)
    labels |= {name for lang in languages.LANGUAGES.values() for name in (lang.english_name, lang.chinese_name)}
    scripts = {s for group in languages._SCRIPTS.values() for s in group} | {"hant", "hans", "bopo"}
    labels |= {f"{alias}_{script.title()}" for alias in languages._BASE_ALIASES for script in scripts}
    return sorted(labels)


def test_preflight_resolves_or_refuses_every_known_alias_in_one_line(corpus):
    """Property: over every label the tables know, on either side, preflight either accepts it (and it
    resolves to a Hunyuan-MT language) or refuses it in one line naming the field and the source."""
    from raytrain_hymt.languages import LANGUAGES, is_supported, resolve

    for label in _known_labels():
        for side in ("src_lang", "tgt_lang"):
            other = "zh" if is_supported(label) and resolve(label).code != "zh" else "en"
            langs = {"src_lang": other, "tgt_lang": other, side: label}
            cfg = load_config(None, [sources({"path": str(corpus), "format": "tsv", **langs})])
            try:
                check_inputs(cfg)
            except ConfigError as e:
                line = str(e)
                assert "\n" not in line, line
                assert line.startswith(f"data.sources[0].{side}: {label!r} is not a Hunyuan-MT language "
                                       f"(source '{corpus}'); "), line
                assert not is_supported(label), label
            else:
                assert resolve(label).code in LANGUAGES, label


def test_evaluation_directions_default_to_the_runs_own_corpus(ray_session, tmp_path):
    """Trained on en→ja with a test set of English and Japanese only, no eval.directions: the run scores
    en-ja; and ``hymt evaluate --model`` on the run's model, moved away from the storage root, does too."""
    import shutil

    from conftest import FLORES_DEVTEST

    test_set = tmp_path / "enja"
    test_set.mkdir()
    for stem in ("eng_Latn", "jpn_Jpan"):
        shutil.copy(FLORES_DEVTEST / f"{stem}.devtest", test_set)
    corpus = tmp_path / "en-ja.tsv"
    corpus.write_text("".join(f"{en}\t{ja}\n" for en, ja in flores_pairs("eng_Latn", "jpn_Jpan", 120)), encoding="utf-8")
    ray_address = ray_session.get_runtime_context().gcs_address
    overrides = tiny_overrides(tmp_path / "runs", **{"optim.max_steps": 2, "checkpoint.every_steps": 2,
                                                     "eval.every_steps": 2, "tracking.enabled": "false",
                                                     "data.max_length_ratio": 100, "data.max_val_examples": 4,
                                                     "eval.test_set": test_set, "eval.max_sentences": 2,
                                                     "eval.max_new_tokens": 4})
    overrides.append(sources({"path": str(corpus), "format": "tsv", "src_lang": "en", "tgt_lang": "ja"}))
    run = hymt(tmp_path, "train", "--name", "enja", *[x for o in overrides for x in ("--set", o)],
               ray_address=ray_address)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "enja" / "summary.json").read_text())
    assert list(summary["test_scores"]["scores"]) == ["en-ja"]
    assert yaml.safe_load((tmp_path / "runs" / "enja" / "config.yaml").read_text())["eval"]["directions"] == ["en-ja"]

    elsewhere = tmp_path / "moved"
    shutil.move(tmp_path / "runs" / "enja", elsewhere)
    run = hymt(tmp_path, "evaluate", "--model", str(elsewhere / "model"), "--test-set", str(test_set),
               "--set", f"run.storage_root={tmp_path / 'evals'}", "--set", "tracking.enabled=false",
               "--set", "eval.max_sentences=2", "--set", "eval.max_new_tokens=4", ray_address=ray_address)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "en-ja" in run.stdout and "en-zh" not in run.stdout, run.stdout


# ---- exit 2 for bad input, through the hymt command: one line naming the field, nothing created ---------

def read_only_folder(path: Path) -> str:
    """Make ``path`` a folder this user cannot create anything in; the reason the system gives. Root writes
    through permissions, so for root the folder is made immutable (chattr +i; undone by the test)."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        return "Permission denied"
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("root without chattr +i: no folder is read-only to this user")
    return "Operation not permitted"


def _corpus_folder(tmp_path: Path) -> str:
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.tsv").write_text("Hallo\tHello\n", encoding="utf-8")
    return sources({"path": str(tmp_path / "corpus"), "format": "tsv", "src_lang": "de", "tgt_lang": "en"})


def _jsonl_as_tatoeba(tmp_path: Path) -> str:
    (tmp_path / "c.jsonl").write_text('{"src": "Hallo", "tgt": "Hello"}\n', encoding="utf-8")
    return sources({"path": str(tmp_path / "c.jsonl"), "format": "tatoeba"})


# (name, how the mistake is made from tmp_path: argv, the one line the user reads; "{t}" is tmp_path)
BAD_INPUT = [
    ("storage root is a file", lambda t: (t / "afile").touch() or ["train", "--name", "r", "--set", f"run.storage_root={t}/afile"],
     "run.storage_root: {t}/afile is a file, not a folder (run.storage_root is a folder that holds a folder per run)"),
    ("storage root inside a file", lambda t: (t / "afile").touch() or ["train", "--set", f"run.storage_root={t}/afile/runs"],
     "run.storage_root: {t}/afile is a file, not a folder, so {t}/afile/runs cannot be created (run.storage_root is "
     "a folder that holds a folder per run)"),
    ("prepare into a non-empty folder", lambda t: (t / "out").mkdir() or (t / "out" / "x").touch() or ["prepare", f"{t}/out"],
     "OUT: {t}/out is not empty (1 entry: x); a second dataset is never mixed into it: pass --overwrite to replace "
     "it, or prepare into an empty or new folder"),
    ("prepare into a file", lambda t: (t / "afile").touch() or ["prepare", f"{t}/afile"],
     "OUT: {t}/afile is a file, not a folder (OUT is a folder that holds the prepared dataset: Parquet files and "
     "manifest.json)"),
    ("a folder as corpus file", lambda t: ["train", "--set", _corpus_folder(t)],
     "data.sources[0].path: data source '{t}/corpus' is a folder, not a file; to read the files in it give a glob, "
     "e.g. '{t}/corpus/*.tsv'"),
    ("JSON lines read as tatoeba", lambda t: ["prepare", f"{t}/out", "--set", _jsonl_as_tatoeba(t)],
     "data.sources[0].format: {t}/c.jsonl: line 1 is a JSON object, format 'tatoeba' reads tab-separated columns "
     "(JSON lines: format 'jsonl')"),
    ("another tool's field name", lambda t: ["train", "--set", "optim.learning_rate=1e-4"],
     "invalid configuration:\n  optim.learning_rate: unknown field (got '1e-4', from --set optim.learning_rate=1e-4); "
     "did you mean optim.lr?"),
]


@pytest.mark.parametrize("make, line", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_before_ray_with_nothing_created(tmp_path, make, line):
    work = tmp_path / "w"
    work.mkdir()
    argv = make(work)
    run = hymt(tmp_path, *argv, *(["--set", f"run.storage_root={work}/runs"] if "run.storage_root" not in line else []))
    assert_refused(run, line.format(t=work))
    home = tmp_path / "home"
    assert not list(home.rglob("session_*")) and not (home / "hymt_runs").exists(), list(home.rglob("*"))
    assert not (work / "runs").exists()
    assert sorted(p.name for p in work.iterdir() if p.name not in ("afile", "out", "corpus", "c.jsonl")) == []


def test_a_read_only_storage_root_is_one_line_before_ray(tmp_path):
    ro = tmp_path / "ro"
    reason = read_only_folder(ro)
    try:
        run = hymt(tmp_path, "train", "--name", "r", "--set", f"run.storage_root={ro}")
        assert_refused(run, f"run.storage_root: {ro} is not writable ({reason})")
        run = hymt(tmp_path, "prepare", str(ro / "out"))
        assert_refused(run, f"OUT: cannot create {ro}/out: {ro} is not writable ({reason})")
        assert list(ro.iterdir()) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(ro)], check=True)


def test_a_start_that_fails_leaves_no_run_folder_and_the_fixed_resubmission_is_a_new_run(tmp_path):
    """A local Ray of one logical CPU cannot place 2 workers: refused once Ray started, so in the old order
    the run folder and its config.yaml already existed and held the name to a config that never trained."""
    from raytrain_hymt.driver.train import open_run

    import shutil
    import tempfile

    runs = tmp_path / "runs"
    short = Path(tempfile.mkdtemp(prefix="hymt-", dir="/tmp"))  # Ray's socket paths must stay under 108 bytes
    try:
        run = hymt(short, "train", "--name", "r", "--set", f"run.storage_root={runs}", "--set",
                   "scaling.local_num_cpus=1", "--set", "tracking.enabled=false")
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.startswith("error: scaling.num_workers"), run.stderr[-3000:]
    assert not (runs / "r").exists(), sorted(p.name for p in (runs / "r").rglob("*"))
    fixed = load_config(None, [f"run.storage_root={runs}", "run.name=r", "scaling.num_workers=1", "optim.max_steps=3"])
    folder, _ = open_run(fixed)  # the check a resubmission goes through before Ray: no "started with another config"
    assert not folder.created and not (runs / "r").exists()
