"""BLEU/chrF on a held-out test set: planning and scoring (pure), the end-of-run evaluation of conftest's
``finished_run`` on FLORES-200 devtest, and ``hymt evaluate`` on a run and on any model folder."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import sacrebleu

from raytrain_hymt.cli import main
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.languages import parse_direction
from raytrain_hymt.evaluation.scoring import bleu_tokenizer, score
from raytrain_hymt.evaluation.scoring import load_test_set, plan_rows, read_sentences
from raytrain_hymt.evaluation.scoring import read_history
from raytrain_hymt.driver.train import preflight

from conftest import FLORES_DEVTEST

# ---- pure: directions, test sets, scores -------------------------------------------------------------


def test_directions_split_where_both_sides_are_languages():
    assert parse_direction("en-zh") == ("en", "zh")
    assert parse_direction("zh-Hant-en") == ("zh-Hant", "en")
    assert parse_direction("en-zh-TW") == ("en", "zh-Hant")
    assert parse_direction("eng_Latn-zho_Hans") == ("en", "zh")
    with pytest.raises(ConfigError, match=r"eval.directions: 'en-xx' does not name two Hunyuan-MT languages; "
                                          r"write <source>-<target>, e.g. en-zh or zh-Hant-en"):
        parse_direction("en-xx")
    with pytest.raises(ConfigError, match="eval.directions: 'enzh' does not name two"):
        load_config(None, ["eval.directions=[enzh]"])


def test_bleu_tokenizes_by_target_script():
    assert [bleu_tokenizer(c) for c in ("zh", "zh-Hant", "yue", "ja", "th", "de", "en", "ko")] == [
        "zh", "zh", "zh", "char", "char", "13a", "13a", "13a"]


def test_scores_are_sacrebleus_with_the_target_tokenizer():
    perfect = score(["the cat sat on the mat"], ["the cat sat on the mat"], "en")
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    zh = score(["我喜欢猫。"], ["我喜欢狗。"], "zh")
    # Character-level for Chinese: 4/5 unigrams, 2/4 bigrams, 1/3 trigrams match. 13a would see one
    # "word" per sentence and score 0.
    assert zh["bleu"] == pytest.approx(42.7287006, abs=1e-6)
    assert sacrebleu.corpus_bleu(["我喜欢猫。"], [["我喜欢狗。"]], tokenize="13a").score == 0.0
    assert zh["chrf"] == pytest.approx(32.6666667, abs=1e-6)
    assert zh["bleu_signature"] == "nrefs:1|case:mixed|eff:no|tok:zh|smooth:exp|version:2.6.0"
    assert score(["猫が好きです。"], ["犬が好きです。"], "ja")["bleu"] == pytest.approx(80.9106712, abs=1e-6)


def test_chrfpp_and_ter_sit_beside_bleu_with_their_signatures():
    en = score(["the cat sat on a mat"], ["the cat sat on the mat"], "en")
    assert en["chrfpp"] == pytest.approx(sacrebleu.corpus_chrf(["the cat sat on a mat"], [["the cat sat on the mat"]],
                                                               word_order=2).score)
    assert en["ter"] == pytest.approx(100 / 6)  # one substitution in six reference words
    assert en["chrfpp_signature"] == "nrefs:1|case:mixed|eff:yes|nc:6|nw:2|space:no|version:2.6.0"
    assert en["ter_signature"] == "nrefs:1|case:lc|tok:tercom|norm:no|punct:yes|asian:no|version:2.6.0"
    # Chinese and Japanese: TER with asian_support splits characters (one of five edited), not one word.
    zh = score(["我喜欢猫。"], ["我喜欢狗。"], "zh")
    assert zh["ter"] == pytest.approx(20.0) and "asian:yes" in zh["ter_signature"]
    assert "asian:yes" in score(["猫"], ["犬"], "ja")["ter_signature"]
    assert "asian:no" in score(["Kot"], ["Pies"], "de")["ter_signature"]


def test_every_evaluation_is_kept_in_the_history(tmp_path):
    from raytrain_hymt.evaluation.scoring import new_evaluation_dir, record_evaluation

    root = tmp_path / "devtest"
    first, second = new_evaluation_dir(root), new_evaluation_dir(root)
    assert first != second and second.name.startswith(first.name)  # the same second: a suffix
    record_evaluation(first, {"step": 10, "scores": {"en-zh": {"bleu": 1.0}}}, {"en-zh": ["a\nb", "c"]})
    record_evaluation(second, {"step": 20, "scores": {"en-zh": {"bleu": 2.0}}}, {"en-zh": ["d", "e"]})
    assert [(h["dir"], h["step"]) for h in read_history(root)] == [(first.name, 10), (second.name, 20)]
    assert (first / "en-zh.hyp").read_text() == "a b\nc\n"
    assert json.loads((second / "scores.json").read_text()) == {"step": 20, "scores": {"en-zh": {"bleu": 2.0}}}


def test_flores_folder_is_a_multiway_test_set():
    folder = FLORES_DEVTEST
    ts = load_test_set(str(folder))
    assert sorted(ts.files) == ["de", "en", "ja", "zh"] and ts.lines == 200 and ts.name == "devtest"
    rows = plan_rows(ts, ["en-zh", "de-ja"], 3)
    en = (folder / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()
    zh = (folder / "zho_Hans.devtest").read_text(encoding="utf-8").splitlines()
    assert [r["id"] for r in rows] == list(range(6))
    assert [r["direction"] for r in rows] == ["en-zh"] * 3 + ["de-ja"] * 3
    assert [(r["src"], r["ref"]) for r in rows[:3]] == list(zip(en[:3], zh[:3]))
    assert (rows[3]["src_lang"], rows[3]["tgt_lang"], rows[5]["index"]) == ("de", "ja", 2)
    with pytest.raises(ConfigError, match=r"eval.directions: en-fr needs fr, but .*devtest has only de, en, ja, zh"):
        plan_rows(ts, ["en-fr"], None)


def test_bad_test_sets_are_refused_with_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r"eval.test_set: .*missing is not a folder"):
        load_test_set(str(tmp_path / "missing"))
    (tmp_path / "README.md").write_text("notes\n")
    with pytest.raises(ConfigError, match=r"no file in .* is named by a language"):
        load_test_set(str(tmp_path))
    (tmp_path / "en.txt").write_text("a\nb\nc\n")
    (tmp_path / "zh.txt").write_text("甲\n乙\n")
    with pytest.raises(ConfigError, match=r"not line-aligned \(en.txt: 3, zh.txt: 2 lines\)"):
        load_test_set(str(tmp_path))
    # Only a newline ends a sentence: a form feed or U+2028 inside one, or CRLF endings, change nothing.
    (tmp_path / "zh.txt").write_bytes("甲\x0c甲\r\n乙\u2028乙\r\n丙".encode())
    ts = load_test_set(str(tmp_path))
    assert ts.lines == 3 and read_sentences(ts.files["zh"]) == ["甲\x0c甲", "乙\u2028乙", "丙"]
    (tmp_path / "de.txt").write_text("")
    with pytest.raises(ConfigError, match=r"de.txt in .* has no lines"):
        load_test_set(str(tmp_path))
    (tmp_path / "de.txt").unlink()
    (tmp_path / "eng_Latn.devtest").write_text("a\nb\nc\n")
    with pytest.raises(ConfigError, match=r"en.txt and eng_Latn.devtest in .* are both en"):
        load_test_set(str(tmp_path))


def test_a_wrong_test_set_stops_the_run_before_ray_starts(tmp_path):
    cfg = load_config(None, [f"eval.test_set={tmp_path / 'nowhere'}"])
    with pytest.raises(ConfigError, match="nowhere is not a folder"):
        preflight(cfg)
    with pytest.raises(ConfigError, match="eval.test_set scores the exported model at the end of a run: it needs "
                                          "run.export: true"):
        preflight(load_config(None, [f"eval.test_set={tmp_path}", "run.export=false"]))
    with pytest.raises(ConfigError, match=r"eval.directions: 'eng_Latn-zho_Hans' is 'en-zh' again \(en-zh\)"):
        load_config(None, ["eval.directions=[en-zh, eng_Latn-zho_Hans]"])


# ---- integration: the end of a run, and hymt evaluate ------------------------------------------------


def _hyps(folder: Path, direction: str) -> list[str]:
    return (folder / f"{direction}.hyp").read_text(encoding="utf-8").splitlines()


def _latest(set_root: Path) -> Path:
    """The folder of the newest evaluation in ``set_root``'s history."""
    return set_root / read_history(set_root)[-1]["dir"]


@pytest.mark.integration
def test_a_run_ends_with_bleu_and_chrf_in_its_summary_files_and_mlflow(finished_run):
    import mlflow

    storage, summary = finished_run
    eval_dir = _latest(Path(summary.run_dir) / "eval" / "devtest")
    refs = {"zh": (FLORES_DEVTEST / "zho_Hans.devtest").read_text(encoding="utf-8").splitlines()[:4],
            "en": (FLORES_DEVTEST / "eng_Latn.devtest").read_text(encoding="utf-8").splitlines()[:4]}
    scores = summary.test_scores["scores"]
    assert summary.test_scores["test_set"] == "devtest" and list(scores) == ["en-zh", "zh-en"]
    for direction, target in (("en-zh", "zh"), ("zh-en", "en")):
        hyps = _hyps(eval_dir, direction)
        assert len(hyps) == 4 and scores[direction]["sentences"] == 4
        # The recorded scores are exactly sacrebleu's on the written translations.
        assert scores[direction]["bleu"] == sacrebleu.corpus_bleu(hyps, [refs[target]], tokenize=bleu_tokenizer(target)).score
        assert scores[direction]["chrf"] == sacrebleu.corpus_chrf(hyps, [refs[target]]).score
    recorded = json.loads((eval_dir / "scores.json").read_text())
    assert recorded["scores"] == scores and recorded["step"] == 20 and recorded["time"] == eval_dir.name
    assert "  BLEU/chrF:    en-zh " in "\n".join(summary.lines())
    client = mlflow.MlflowClient(summary.tracking_uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.metrics["test/devtest/en-zh/bleu"] == pytest.approx(scores["en-zh"]["bleu"])
    assert run.data.metrics["test/devtest/zh-en/chrf"] == pytest.approx(scores["zh-en"]["chrf"])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "test/devtest/en-zh/bleu")] == [20]
    assert run.data.metrics["test/devtest/en-zh/chrfpp"] == pytest.approx(scores["en-zh"]["chrfpp"])
    assert run.data.metrics["test/devtest/en-zh/ter"] == pytest.approx(scores["en-zh"]["ter"])
    stamp = f"eval/devtest/{eval_dir.name}"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "eval/devtest")}
    assert {stamp, "eval/devtest/history.jsonl"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, stamp)} == {
        f"{stamp}/en-zh.hyp", f"{stamp}/zh-en.hyp", f"{stamp}/scores.json"}


@pytest.mark.integration
def test_hymt_evaluate_scores_a_run_and_any_model_folder_alike(finished_run, capsys):
    import mlflow

    from conftest import E2E_EVAL

    storage, summary = finished_run
    common = ["--test-set", str(FLORES_DEVTEST), "--set", f"run.storage_root={storage}"]
    common += [a for k, v in E2E_EVAL.items() for a in ("--set", f"{k}={v}")]
    set_root = Path(summary.run_dir) / "eval" / "devtest"
    before = {d: _hyps(_latest(set_root), d) for d in ("en-zh", "zh-en")}
    evaluations = len(read_history(set_root))

    # The finished run again: greedy decoding gives the same translations, logged into the run's own
    # MLflow run at its last step.
    assert main(["evaluate", "--name", "e2e", *common]) == 0
    out = capsys.readouterr().out
    assert "test set devtest:" in out and "  en-zh              4" in out
    # A new evaluation joins the history; the older ones stay.
    history = read_history(set_root)
    assert len(history) == evaluations + 1 and all((set_root / h["dir"] / "scores.json").exists() for h in history)
    assert history[-1]["step"] == 20 and history[-1]["scores"] == history[0]["scores"]
    assert {d: _hyps(_latest(set_root), d) for d in before} == before
    client = mlflow.MlflowClient(summary.tracking_uri)
    history = client.get_metric_history(summary.mlflow_run_id, "test/devtest/en-zh/bleu")
    assert [m.step for m in history] == [20, 20] and history[0].value == history[1].value

    # The same weights as "any model", given as a URI (what reaches replicas on every node of a cluster):
    # a run of its own, the same scores at step 0, and each replica's local copy deleted once loaded.
    uri = f"file://{summary.model_dir}"
    copies = set(Path(tempfile.gettempdir()).glob("hymt-eval-model-*"))
    assert main(["evaluate", "--model", uri, "--name", "baseline", *common]) == 0
    assert set(Path(tempfile.gettempdir()).glob("hymt-eval-model-*")) == copies
    baseline = json.loads((_latest(storage / "baseline" / "eval" / "devtest") / "scores.json").read_text())
    assert baseline["scores"] == summary.test_scores["scores"]
    run_id = json.loads((storage / "baseline" / "run.json").read_text())["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.info.run_name == "baseline" and run.data.tags["evaluated_model"] == uri
    assert run.data.metrics["test/devtest/zh-en/bleu"] == pytest.approx(summary.test_scores["scores"]["zh-en"]["bleu"])
    # Scoring the same model again continues that MLflow run and adds the new measurement.
    assert main(["evaluate", "--model", uri, "--name", "baseline", *common]) == 0
    assert json.loads((storage / "baseline" / "run.json").read_text())["mlflow_run_id"] == run_id
    assert [m.step for m in client.get_metric_history(run_id, "test/devtest/zh-en/bleu")] == [0, 0]
    assert len(read_history(storage / "baseline" / "eval" / "devtest")) == 2
    assert client.get_run(run_id).info.status == "FINISHED"

    # A direction the test set cannot serve: exit 2 with the reason, before any model is loaded.
    assert main(["evaluate", "--name", "e2e", *common, "--directions", "en-fr"]) == 2
    err = capsys.readouterr().err
    assert "error: eval.directions: en-fr needs fr, but" in err and "has only de, en, ja, zh" in err


def test_hymt_evaluate_ignores_the_device_a_run_trained_on_unless_chosen(tmp_path, monkeypatch):
    from raytrain_hymt.config.schema import to_yaml

    # A run trained on GPUs in bf16 (its saved config.yaml is all hymt evaluate reads before scoring).
    trained = load_config(None, ["scaling.use_gpu=true", "deepspeed.precision=bf16", "optim.lr=1e-4"])
    (tmp_path / "gpu-run").mkdir()
    (tmp_path / "gpu-run" / "config.yaml").write_text(to_yaml(trained))
    seen = []

    # Stands in for the scoring itself (Ray Data replicas): records the config and device choices it is given.
    def recording(cfg, model=None, explicit_device=None):
        seen.append((cfg.scaling.use_gpu, cfg.deepspeed.precision, cfg.optim.lr, explicit_device))
        raise ConfigError("recorded")

    monkeypatch.setattr("raytrain_hymt.driver.evaluate.evaluate_run", recording)
    args = ["evaluate", "--name", "gpu-run", "--test-set", str(FLORES_DEVTEST), "--set", f"run.storage_root={tmp_path}"]
    assert main(args) == 2  # this CPU machine
    assert main([*args, "--set", "deepspeed.precision=bf16"]) == 2
    monkeypatch.setattr("raytrain_hymt.driver.evaluate.local_gpu", lambda: (True, False))  # stands in for a V100
    assert main(args) == 2
    assert main([*args, "--set", "scaling.use_gpu=false"]) == 2
    monkeypatch.setattr("raytrain_hymt.driver.evaluate.local_gpu", lambda: (True, True))  # for an H100
    assert main(args) == 2
    assert main([*args, "--config", "tiny-cpu"]) == 2  # a named preset's precision is a choice; its lr too
    assert seen == [(False, "fp32", 1e-4, {}), (False, "bf16", 1e-4, {"deepspeed.precision": "bf16"}),
                    (True, "fp16", 1e-4, {}), (False, "fp32", 1e-4, {"scaling.use_gpu": False}),
                    (True, "bf16", 1e-4, {}), (True, "fp32", 2e-3, {"deepspeed.precision": "fp32"})]
