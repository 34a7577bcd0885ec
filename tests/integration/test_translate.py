"""``hymt translate``: inputs (arguments, file, stdin), outputs (stdout, file) in order, every way of
naming a model, the Ray Data path, per-line problem reports, and the clear messages for bad input."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from conftest import REPO

from raytrain_hymt.cli import main

SHORT = ["--set", "eval.max_new_tokens=8"]
SENTENCES = ["Hello.", "The cat sat on the mat.", "Where is the station?"]


def _translate(capsys, *args: str) -> tuple[int, list[str], str]:
    rc = main(["translate", *SHORT, *args])
    captured = capsys.readouterr()
    return rc, captured.out.splitlines(), captured.err


def test_arguments_file_and_stdin_give_the_same_translations_in_input_order(capsys, tmp_path, monkeypatch):
    from raytrain_hymt.evaluation.generation import translate_all
    from raytrain_hymt.train.model import load_generator

    rc, out, err = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh", *SENTENCES)
    assert rc == 0 and err == ""
    g = load_generator("tiny", "fp32", 8, use_gpu=False)
    assert out == translate_all(g, SENTENCES, ["en"] * 3, ["zh"] * 3, batch_size=64)[0]
    # Longest-first batching makes the batch the same whatever the input order: reversed in, reversed out.
    assert _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh", *SENTENCES[::-1])[1] == out[::-1]
    # A file with a blank line: the blank line stays blank, the others are translated in their places.
    src = tmp_path / "in.txt"
    src.write_text(f"{SENTENCES[0]}\n\n{SENTENCES[1]}\n{SENTENCES[2]}\n", encoding="utf-8")
    dst = tmp_path / "out.txt"
    rc, printed, _ = _translate(capsys, "-m", "tiny", "--from", "eng_Latn", "--to", "zho_Hans", "-i", str(src),
                                "-o", str(dst))
    assert rc == 0 and printed == []
    assert dst.read_text(encoding="utf-8").split("\n") == [out[0], "", out[1], out[2], ""]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(SENTENCES) + "\n"))
    assert _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh")[1] == out


def test_sampling_uses_the_model_card_settings_reproducibly(capsys):
    greedy = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh", *SENTENCES)[1]
    sampled = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh", "--sample", *SENTENCES)[1]
    assert sampled != greedy and len(sampled) == 3
    assert _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh", "--sample", *SENTENCES)[1] == sampled


def test_a_failed_or_empty_sentence_is_reported_by_line_and_loses_no_other(capsys, monkeypatch):
    from raytrain_hymt.evaluation.generation import Generator

    real = Generator.translate

    # Stands in for a sentence the model cannot take (out of memory, a tokenizer error) and for a model
    # that answers nothing: the real generator, failing or emptying the marked sentences.
    def flaky(self, sources, src_langs, tgt_langs, synced_gpus=False):
        if any("BOOM" in s for s in sources):
            raise RuntimeError("CUDA out of memory (stand-in)")
        return ["" if "EMPTY" in s else t for s, t in zip(sources, real(self, sources, src_langs, tgt_langs))]

    monkeypatch.setattr(Generator, "translate", flaky)
    rc, out, err = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "de", "Hello.", "BOOM here", "EMPTY",
                              "The cat sat on the mat.")
    assert rc == 1 and len(out) == 4 and out[1] == out[2] == "" and out[0] and out[3]
    assert err.splitlines() == ["line 2: failed: RuntimeError: CUDA out of memory (stand-in)",
                                "line 3: the translation came back empty"]


def test_bad_input_gets_a_clear_message(capsys, tmp_path, monkeypatch):
    rc, _, err = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "klingon", "Hello.")
    assert rc == 2 and err.startswith("error: --from/--to: language label 'klingon' is not a Hunyuan-MT language")
    assert "data.on_unsupported_language" not in err
    rc, _, err = _translate(capsys, "-m", str(tmp_path / "nowhere"), "--from", "en", "--to", "zh", "Hello.")
    assert rc == 2 and f"error: model {tmp_path / 'nowhere'}: no such folder, and no finished run" in err
    rc, _, err = _translate(capsys, "-m", str(tmp_path), "--from", "en", "--to", "zh", "Hello.")
    assert rc == 2 and "holds neither an exported model (config.json) nor a checkpoint" in err
    (tmp_path / "blank.txt").write_text("\n  \n")
    rc, _, err = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh", "-i", str(tmp_path / "blank.txt"))
    assert rc == 2 and err == f"error: nothing to translate: --input {tmp_path / 'blank.txt'} holds no non-empty line\n"
    rc, _, err = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh", "-i", str(tmp_path / "missing.txt"))
    assert rc == 2 and "no such file" in err
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    rc, _, err = _translate(capsys, "-m", "tiny", "--from", "en", "--to", "zh")
    assert rc == 2 and err == "error: nothing to translate: stdin holds no non-empty line\n"


@pytest.mark.integration
def test_run_name_checkpoint_export_and_ray_pool_translate_alike(finished_run, capsys):
    storage, summary = finished_run
    common = ["--from", "en", "--to", "zh", "--set", f"run.storage_root={storage}", *SENTENCES]
    by_export = _translate(capsys, "-m", summary.model_dir, *common)
    assert by_export[0] == 0 and len(by_export[1]) == 3
    assert _translate(capsys, "-m", "e2e", *common) == by_export
    # A checkpoint, in a process of its own as users run it: DeepSpeed is first imported there (by the export),
    # and its "Setting accelerator to CPU" warning stays off the console.
    env = {k: v for k, v in os.environ.items() if k not in ("HYMT_VERBOSE", "DS_ACCELERATOR", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    own = subprocess.run([sys.executable, "-m", "raytrain_hymt.cli", "translate", *SHORT, "-m", summary.checkpoint,
                          *common], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert (own.returncode, own.stdout.splitlines()) == by_export[:2], own.stderr
    assert own.stderr.splitlines() == [f"exporting checkpoint {summary.checkpoint} to a temporary folder first"]
    # The cluster path: evaluation's Ray Data actor pool (the session's Ray is running), same translations.
    assert _translate(capsys, "-m", "e2e", "--ray", *common)[:2] == by_export[:2]


def test_the_device_is_this_machines_unless_chosen_and_a_choice_is_honoured(capsys, monkeypatch):
    import torch

    import raytrain_hymt.train.model as model_module

    real, asked = model_module.load_generator, []

    # Records what translate asks for and what it got (the real loader, real model).
    def recording(model, precision, max_new_tokens, use_gpu, *args, **kwargs):
        asked.append((precision, use_gpu))
        g = real(model, precision, max_new_tokens, use_gpu, *args, **kwargs)
        asked[-1] += (next(g.model.parameters()).dtype, g.device.type)
        return g

    monkeypatch.setattr(model_module, "load_generator", recording)
    args = ["-m", "tiny", "--from", "en", "--to", "zh", "Hello."]
    # This CPU machine, no flags: fp32 on the CPU, as before.
    assert _translate(capsys, *args)[0] == 0
    # Forced: bf16 on the CPU.
    assert _translate(capsys, "--set", "deepspeed.precision=bf16", *args)[0] == 0
    # A GPU machine stands in (this process's torch.cuda answers yes, with bf16) for the choices that
    # keep the model on the CPU: the device chosen, or a named --config that sets it.
    monkeypatch.setattr("raytrain_hymt.driver.evaluate.local_gpu", lambda: (True, True))
    assert _translate(capsys, "--set", "scaling.use_gpu=false", *args)[0] == 0
    assert _translate(capsys, "--set", "scaling.use_gpu=false", "--set", "deepspeed.precision=bf16", *args)[0] == 0
    # No flags there: the GPU in bf16 is asked for (this CPU build of torch then cannot load it).
    assert _translate(capsys, *args)[0] == 1
    assert asked == [("fp32", False, torch.float32, "cpu"), ("bf16", False, torch.bfloat16, "cpu"),
                     ("fp32", False, torch.float32, "cpu"), ("bf16", False, torch.bfloat16, "cpu"), ("bf16", True)]
    # fp16 is a GPU precision: chosen on a CPU machine, one line saying so.
    monkeypatch.setattr("raytrain_hymt.driver.evaluate.local_gpu", lambda: (False, False))
    rc, _, err = _translate(capsys, "--set", "deepspeed.precision=fp16", *args)
    assert rc == 2 and "deepspeed.precision fp16 needs GPUs (scaling.use_gpu: true)" in err
