"""Commands and checks that need no cluster run without Ray: ``hymt preview`` (the first training examples
as tokenized, the masked prompt marked), ``hymt export``'s refusals of a missing or cut-off checkpoint,
and ``hymt plot``. Each goes through ``cli.main`` in this process; the unit tests' guard (tests/conftest.py)
fails any of them that starts Ray. The exports themselves, from a trained run's checkpoint, are in
tests/integration/test_export.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_hymt import cli
from raytrain_hymt.driver.preview import Example
from run_folders import cut_off_checkpoint as _cut_off_checkpoint

PROMPT_EN = "Translate the following segment into English, without additional explanation.\n\n"
PROMPT_DE = "Translate the following segment into German, without additional explanation.\n\n"


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A de-en TSV whose first row is dropped by cleaning (identical sides)."""
    path = tmp_path / "de-en.tsv"
    path.write_text("Ja\tJa\nDanke schön.\tThank you very much.\nGuten Morgen!\tGood morning!\nNein\tNo\n",
                    encoding="utf-8")
    return path


def _preview(capsys, corpus: Path, *extra: str) -> tuple[int, str]:
    source = {"path": str(corpus), "format": "tsv", "src_lang": "de", "tgt_lang": "en"}
    code = cli.main(["preview", "--set", f"data.sources={json.dumps([source])}", "--set", "data.val_fraction=0",
                     *extra])
    return code, capsys.readouterr().out


def test_preview_prints_the_examples_as_tokenized_with_the_masked_prompt_marked(capsys, corpus):
    code, out = _preview(capsys, corpus, "-n", "2")
    assert code == 0
    assert out == (
        "2 training examples of data.sources in file order, as tokenized for training; ⟦…⟧: masked from the loss "
        "(labels -100), the rest is trained\n"
        "\n"
        f"{corpus}:1  de→en  not trained: identical\n"
        "\n"
        f"{corpus}:2  de→en\n"
        f"⟦<|startoftext|>{PROMPT_EN}Danke schön.<|extra_0|>⟧Thank you very much.<|eos|>\n"
        "\n"
        f"{corpus}:3  de→en\n"
        f"⟦<|startoftext|>{PROMPT_EN}Guten Morgen!<|extra_0|>⟧Good morning!<|eos|>\n"
    )


def test_preview_shows_each_pairs_reverse_after_it_and_says_when_the_sources_run_out(capsys, corpus):
    code, out = _preview(capsys, corpus, "-n", "9", "--set", "data.both_directions=true",
                         "--set", "data.min_chars=3")
    assert code == 0
    assert out == (
        "4 training examples of data.sources in file order, as tokenized for training; ⟦…⟧: masked from the loss "
        "(labels -100), the rest is trained\n"
        "\n"
        f"{corpus}:1  de→en  not trained: too_short\n"  # data.min_chars comes before the identical sides
        "\n"
        f"{corpus}:2  de→en\n"
        f"⟦<|startoftext|>{PROMPT_EN}Danke schön.<|extra_0|>⟧Thank you very much.<|eos|>\n"
        "\n"
        f"{corpus}:2  en→de, reversed\n"
        f"⟦<|startoftext|>{PROMPT_DE}Thank you very much.<|extra_0|>⟧Danke schön.<|eos|>\n"
        "\n"
        f"{corpus}:3  de→en\n"
        f"⟦<|startoftext|>{PROMPT_EN}Guten Morgen!<|extra_0|>⟧Good morning!<|eos|>\n"
        "\n"
        f"{corpus}:3  en→de, reversed\n"
        f"⟦<|startoftext|>{PROMPT_DE}Good morning!<|extra_0|>⟧Guten Morgen!<|eos|>\n"
        "\n"
        f"{corpus}:4  de→en  not trained: too_short\n"
        "\n"
        "(the sources hold no more training examples than these 4)\n"
    )


def test_preview_dims_the_masked_part_on_a_terminal():
    example = Example("c.tsv:2", "de→en", False, [("<s>prompt", False), ("answer</s>", True)])
    assert example.lines(color=True)[1] == "\x1b[2m⟦<s>prompt⟧\x1b[0manswer</s>"
    assert example.lines()[1] == "⟦<s>prompt⟧answer</s>"


def test_preview_of_a_prepared_dataset_is_refused_in_one_line(capsys):
    assert cli.main(["preview", "--set", "data.prepared_path=/data/prep"]) == 2
    assert capsys.readouterr().err == (
        "error: data.prepared_path: /data/prep holds tokenized rows without their source lines; hymt preview "
        "reads data.sources (preview the config the dataset was prepared from)\n")


# ---- hymt export: what is refused before anything starts ---------------------------------------------------


@pytest.mark.parametrize("case", ["no such folder", "not a checkpoint", "cut off", "run without checkpoints",
                                  "run whose checkpoints are cut off", "output holds something else"])
def test_export_refuses_a_missing_or_cut_off_checkpoint_in_one_line(capsys, tmp_path, case):
    out = tmp_path / "model"
    ckpt = tmp_path / "run" / "checkpoint_step00000004"
    if case == "no such folder":
        arg, line = tmp_path / "nope", f"{tmp_path}/nope: no such folder (a checkpoint is a run's checkpoint_step* folder)"
    elif case == "not a checkpoint":
        (tmp_path / "notes").mkdir()
        arg, line = tmp_path / "notes", (
            f"{tmp_path}/notes is not a checkpoint: it has no state.json and no complete/ markers (a checkpoint is a "
            "run's checkpoint_step* folder, e.g. <run.storage_root>/<name>/checkpoint_step00000020)")
    elif case == "cut off":
        arg, line = _cut_off_checkpoint(ckpt), f"{ckpt}: ranks [1] did not finish writing their part (no marker)"
    elif case == "run without checkpoints":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.yaml").write_text("{}")
        arg, line = tmp_path / "run", (
            f"{tmp_path}/run is a run folder without checkpoints (no checkpoint_step* folder: the run saved none "
            "yet; checkpoint.every_steps sets how often it saves)")
    elif case == "run whose checkpoints are cut off":
        _cut_off_checkpoint(ckpt)
        arg, line = tmp_path / "run", (
            f"{tmp_path}/run: none of the run's 1 checkpoints is whole; the newest: {ckpt}: ranks [1] did not "
            "finish writing their part (no marker)")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        (ckpt / "hf").mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": 4, "epoch": 0, "batch_in_epoch": 4, "world_size": 1,
                                                     "tag": "step00000004", "zero_stage": 2}))
        (ckpt / "complete").mkdir()
        (ckpt / "complete" / "rank0").write_text(json.dumps({"files": {}}))
        arg, line = ckpt, f"{out} exists and is not a model folder; export to a new or empty folder"
    assert cli.main(["export", str(arg), str(out)]) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert case == "output holds something else" or not out.exists()


# ---- hymt plot -------------------------------------------------------------------------------------------


def test_plot_of_a_run_folder_starts_no_ray(capsys, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "metric", "step": s, "key": "train/loss", "value": 5.0 - s / 10, "time": 0}) + "\n"
        for s in range(1, 4)))
    assert cli.main(["plot", "r", "--set", f"run.storage_root={tmp_path}", "-o", str(tmp_path / "p.png")]) == 0
    assert capsys.readouterr().out == f"plot: {tmp_path / 'p.png'}\n"
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
