"""Data that reproduces anywhere (issue #15): ids from names relative to a source's root, a data
fingerprint in every checkpoint checked on resume, a new seeded order every epoch (its lanes are tested
in tests/integration/test_rank_reading.py), sort partitions sized from the data, and ``hymt prepare`` that never
mixes two datasets.

The training test runs the real stack (Ray Train, DeepSpeed ZeRO-2 fp32, 2 CPU workers, the tiny model)
on a 28-pair corpus copied into two folders: a reference run from the first copy, and a run from the
second copy that fails in the middle of its second epoch and resumes. Per-step records (example ids and
losses, ``faults.record_step``) stand in for looking inside the workers.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fault_tolerance_common import attempts, effective, read_records
from raytrain_hymt.cli import main
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.data.epochs import batches
from raytrain_hymt.data.fingerprint import DataChangedError, check_same_data, compare_fingerprints, sources_fingerprint
from raytrain_hymt.data.pipeline import PARTITION_BYTES, build_datasets, sort_partitions
from raytrain_hymt.errors import ConfigError
from raytrain_hymt.data.files import file_name, source_root
from raytrain_hymt.data.files import SAMPLE_CORPUS

PAIRS = 28
GLOBAL_ROWS = 4  # 2 workers × micro-batch 2


def _corpus(folder: Path, lines: int = PAIRS) -> Path:
    """The sample's first ``lines`` lines as ``<folder>/corpus.tsv``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "corpus.tsv"
    path.write_text("\n".join(SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:lines]) + "\n", encoding="utf-8")
    return path


def _overrides(corpus: Path, storage: Path, name: str, **extra) -> list[str]:
    values = {
        "data.sources": f"[{{path: '{corpus.parent}/*.tsv', format: tatoeba}}]", "data.val_fraction": 0.0,
        "data.pack_tokens": 128, "data.max_example_tokens": 128, "run.storage_root": str(storage), "run.name": name,
        "run.export": False, "tracking.enabled": False, "eval.every_steps": 1000,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


# ----------------------------------------------------------------------------------------- pure


def test_files_are_named_relative_to_the_source_root(tmp_path):
    assert source_root(f"{tmp_path}/wmt/*.tsv") == f"{tmp_path}/wmt"
    assert source_root(f"{tmp_path}/wmt/corpus.tsv") == f"{tmp_path}/wmt"
    assert source_root(f"{tmp_path}/news/*/train") == f"{tmp_path}/news"  # a Moses prefix glob
    assert source_root("s3://bucket/news/*.tsv.gz") == "s3://bucket/news"
    assert source_root("file:///data/x.tsv") == "file:///data"
    assert file_name(f"{tmp_path}/news/a/train.en", f"{tmp_path}/news").stable == "a/train.en"
    assert file_name("s3://bucket/news/x.tsv.gz", "s3://bucket/news").stable == "x.tsv.gz"


def test_sort_partitions_are_sized_from_the_data():
    cfg = load_config(None, [])
    assert sort_partitions(cfg.data, 10_000) == 2  # at least two (Ray samples boundaries for fewer)
    gib = 2**30
    # 40 GiB of TSV ≈ 200 GiB tokenized: ~1,600 partitions of ~128 MiB, not 16 of 12 GiB.
    assert sort_partitions(cfg.data, 40 * gib) == 1600
    assert 40 * gib * 5 / sort_partitions(cfg.data, 40 * gib) <= PARTITION_BYTES
    cfg.data.both_directions = True
    assert sort_partitions(cfg.data, 40 * gib) == 3200
    cfg.data.sort_partitions = 16
    assert sort_partitions(cfg.data, 40 * gib) == 16
    with pytest.raises(ValueError, match="data.sort_partitions must be 'auto' or at least 2"):
        load_config(None, ["data.sort_partitions=1"])


def test_fingerprint_ignores_where_the_corpus_lives_and_names_what_changed(tmp_path):
    a, b = _corpus(tmp_path / "a"), _corpus(tmp_path / "b")
    fa = sources_fingerprint(load_config(None, _overrides(a, tmp_path, "x")))
    fb = sources_fingerprint(load_config(None, _overrides(b, tmp_path, "x")))
    assert fa["sources"][0]["files"] == fb["sources"][0]["files"] == {"corpus.tsv": [a.stat().st_size, fa["sources"][0]["files"]["corpus.tsv"][1]]}
    assert compare_fingerprints(fa, fb) == []
    assert compare_fingerprints(None, fb) == []  # a checkpoint from before fingerprints

    with open(b, "a", encoding="utf-8") as f:
        f.write("eng\tcmn_Hans\tOne more.\t再来一个。\n")
    (tmp_path / "b" / "more.tsv").write_text("eng\tcmn_Hans\tHi.\t嗨。\n", encoding="utf-8")
    changed = sources_fingerprint(load_config(None, _overrides(b, tmp_path, "x", **{"data.min_chars": 3})))
    old_hash, new_hash = fa["sources"][0]["files"]["corpus.tsv"][1], changed["sources"][0]["files"]["corpus.tsv"][1]
    where = f"data.sources[0] ({tmp_path}/b/*.tsv)"
    assert compare_fingerprints(fa, changed) == [
        f"{where}: file corpus.tsv changed ({a.stat().st_size:,} → {b.stat().st_size:,} bytes, "
        f"content hash {old_hash[:12]} → {new_hash[:12]})",
        f"{where}: file more.tsv is new ({(tmp_path / 'b' / 'more.tsv').stat().st_size:,} bytes)",
        "data.min_chars: 1 → 3",
    ]
    with pytest.raises(DataChangedError) as e:
        check_same_data(fa, changed, allow_change=False, where="runs/x/checkpoint_step00000004, step 4")
    message = str(e.value)
    assert message.startswith("the data differs from the data this run trained on (runs/x/checkpoint_step00000004, step 4):")
    assert "file more.tsv is new" in message and "--set run.allow_config_change=true" in message
    assert check_same_data(fa, changed, allow_change=True) == compare_fingerprints(fa, changed)


# ------------------------------------------------------------------------ training, two copies


@pytest.fixture(scope="module")
def two_copies(ray_session, tmp_path_factory):
    """The corpus in folders a/ and b/; a reference run from a/, and from b/ a run that fails in the
    middle of its second epoch and resumes (``checkpoint.max_failures`` 1)."""
    root = tmp_path_factory.mktemp("copies")
    corpus = {k: _corpus(root / k) for k in ("a", "b")}
    built = {k: build_datasets(load_config(None, _overrides(corpus[k], root / "runs", k))) for k in corpus}
    per_epoch = built["a"][2].train_rows // GLOBAL_ROWS
    assert per_epoch >= 3
    # Checkpoint at step per_epoch + 1 (the second epoch's first batch), fail before the step after it.
    extra = {"optim.max_steps": 2 * per_epoch + 2, "checkpoint.every_steps": per_epoch + 1, "optim.warmup_steps": 0}
    mp = pytest.MonkeyPatch()
    try:
        from raytrain_hymt.driver.train import run_training

        mp.setenv("HYMT_RECORD_DIR", str(root / "record-a"))
        run_training(load_config(None, _overrides(corpus["a"], root / "runs", "a", **extra)), datasets=built["a"])
        mp.setenv("HYMT_RECORD_DIR", str(root / "record-b"))
        fault = {"kind": "raise", "rank": 0, "step": per_epoch + 2, "once": str(root / "raised")}
        mp.setenv("HYMT_FAULTS", json.dumps([fault]))
        run_training(load_config(None, _overrides(corpus["b"], root / "runs", "b", **extra)), datasets=built["b"])
    finally:
        mp.undo()
    records = {k: {rank: read_records(root / f"record-{k}", rank) for rank in (0, 1)} for k in ("a", "b")}
    return {"root": root, "corpus": corpus, "extra": extra, "per_epoch": per_epoch, "records": records,
            "rows": {k: built[k][0].take_all() for k in built}, "stats": {k: built[k][2] for k in built}}


@pytest.mark.integration
def test_a_copied_corpus_gives_identical_packs(two_copies):
    a, b = two_copies["rows"]["a"], two_copies["rows"]["b"]
    assert len(a) == len(b) == two_copies["stats"]["a"].train_rows
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        assert all(np.array_equal(x[k], y[k]) for k in x)
    assert two_copies["stats"]["a"] == two_copies["stats"]["b"]


@pytest.mark.integration
def test_epochs_differ_and_resume_mid_epoch_two_is_exact_from_another_folder(two_copies):
    p, recs = two_copies["per_epoch"], two_copies["records"]
    steps = two_copies["extra"]["optim.max_steps"]
    for rank in (0, 1):
        ref = effective(recs["a"][rank])
        assert len(attempts(recs["a"][rank])) == 1 and sorted(ref) == list(range(1, steps + 1))
        # The run from b/ failed at step p + 2 and resumed from the checkpoint at p + 1 (epoch 2, batch 1) ...
        assert [[r["step"] for r in a] for a in attempts(recs["b"][rank])] == [
            list(range(1, p + 2)), list(range(p + 2, steps + 1))]
        run = effective(recs["b"][rank])
        # ... and trained the reference's rows with the reference's losses at every step, in every epoch.
        for step in range(1, steps + 1):
            assert run[step]["example_ids"] == ref[step]["example_ids"], step
            assert run[step]["loss"] == pytest.approx(ref[step]["loss"], abs=1e-6), step
    both = {s: sorted(effective(recs["a"][0])[s]["example_ids"] + effective(recs["a"][1])[s]["example_ids"])
            for s in range(1, steps + 1)}
    epoch1, epoch2 = [both[s] for s in range(1, p + 1)], [both[s] for s in range(p + 1, 2 * p + 1)]
    assert epoch1 != epoch2  # a new order in the second epoch
    # Each epoch is the documented lane order (data.epochs) of the pipeline's rows: one window here.
    rows = two_copies["rows"]["a"]
    stream = np.array([r["example_ids"] for r in rows] + [None], dtype=object)[:-1]
    fetch = lambda ranges: {"example_ids": np.concatenate([stream[a:b] for a, b in ranges])}  # noqa: E731
    for e, epoch in enumerate((epoch1, epoch2)):
        order = batches(fetch, len(rows), 8192, GLOBAL_ROWS, range(GLOBAL_ROWS), 0, e, 0)
        want = [sorted(np.concatenate(next(order)[2]["example_ids"]).tolist()) for _ in range(p)]
        assert epoch == want
        ids = [x for batch in epoch for x in batch]
        assert len(ids) == len(set(ids))  # no example twice in an epoch


@pytest.mark.integration
def test_checkpoints_carry_the_fingerprint_and_a_changed_corpus_stops_the_resume(two_copies):
    from raytrain_hymt.driver.train import run_training

    root, corpus = two_copies["root"], two_copies["corpus"]["a"]
    newest = sorted((root / "runs" / "a").glob("checkpoint_step*"))[-1]
    saved = json.loads((newest / "state.json").read_text())["data_fingerprint"]
    size = corpus.stat().st_size
    assert saved["sources"][0]["files"] == {"corpus.tsv": [size, saved["sources"][0]["files"]["corpus.tsv"][1]]}
    assert saved["order"] == {"seed": 0, "epoch_shuffle_rows": 8192, "epoch_order": "lanes"}
    assert saved["settings"]["pack_tokens"] == 128 and saved["settings"]["tokenizer"] == "tiny"

    edited = root / "edited" / "corpus.tsv"
    edited.parent.mkdir()
    shutil.copy(corpus, edited)
    with open(edited, "a", encoding="utf-8") as f:
        f.write("eng\tcmn_Hans\tOne more.\t再来一个。\n")
    # The run's data now lives elsewhere and has grown: the resume stops before Ray Train starts.
    cfg = load_config(None, _overrides(edited, root / "runs", "a", **two_copies["extra"]))
    with pytest.raises(DataChangedError) as e:
        run_training(cfg)
    message = str(e.value)
    assert f"({root}/runs/a/{newest.name}, step {two_copies['extra']['optim.max_steps']}):" in message
    assert f"file corpus.tsv changed ({size:,} → {edited.stat().st_size:,} bytes" in message
    assert message.endswith("Resume anyway with --set run.allow_config_change=true, or start a new run (another --name)")


# ------------------------------------------------------------------------ prepare never mixes


def _prepare(corpus: Path, out: Path, *flags: str, **extra) -> int:
    sets = [x for o in _overrides(corpus, out.parent / "runs", "p", **extra) for x in ("--set", o)]
    return main(["prepare", str(out), *flags, *sets])


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _row_multiset(path: Path) -> Counter:
    cfg = load_config(None, [f"data.prepared_path={path}", "data.pack_tokens=128", "data.max_example_tokens=128"])
    train, val, _ = build_datasets(cfg)
    return Counter((tuple(r["example_ids"].tolist()), tuple(r["input_ids"].tolist())) for r in train.take_all() + val.take_all())


@pytest.mark.integration
def test_prepare_refuses_a_non_empty_folder_and_overwrite_gives_one_run(ray_session, tmp_path, capsys):
    corpus, other = _corpus(tmp_path / "c"), _corpus(tmp_path / "d", lines=60)
    out = tmp_path / "out"
    assert _prepare(corpus, out, **{"data.val_fraction": 0.1}) == 0
    first = _tree(out)
    manifest = json.loads(first["manifest.json"])
    assert set(manifest) == {"id", "format", "files", "stats", "prepared_with", "fingerprint"}
    assert sorted(first) == sorted(["manifest.json", "stats.json", *manifest["files"]["train"], *manifest["files"]["val"]])
    rows = _row_multiset(out)
    capsys.readouterr()

    # Another corpus into the same folder: refused, the first dataset untouched.
    assert _prepare(other, out) == 2
    err = capsys.readouterr().err
    assert err == (f"error: OUT: {out} is not empty (a prepared dataset); a second dataset is never mixed into it: "
                   "pass --overwrite to replace it, or prepare into an empty or new folder\n")
    assert _tree(out) == first

    # --overwrite with a source that fails half-way (too many bad lines): nothing prepared is lost.
    bad = tmp_path / "bad" / "corpus.tsv"
    bad.parent.mkdir()
    bad.write_text("one column only\n" + corpus.read_text(encoding="utf-8"), encoding="utf-8")
    assert _prepare(bad, out, "--overwrite", **{"data.max_bad_fraction": 0.0}) == 1
    err = capsys.readouterr().err
    assert f"{bad}:1: malformed: 'expected 4 tab-separated columns, got 1: one column only'" in err
    assert _tree(out) == first

    # --overwrite with the same corpus: the same rows and stats.json as the one run, and nothing else.
    assert _prepare(corpus, out, "--overwrite", **{"data.val_fraction": 0.1}) == 0
    again = _tree(out)
    assert again["stats.json"] == first["stats.json"]
    assert _row_multiset(out) == rows
    second = json.loads(again["manifest.json"])
    assert second["id"] != manifest["id"]  # a new write (its own files), the same data
    assert sorted(again) == sorted(["manifest.json", "stats.json", *second["files"]["train"], *second["files"]["val"]])


def test_a_folder_without_manifest_is_not_a_prepared_dataset(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "part-0.parquet").write_bytes(b"PAR1")
    cfg = load_config(None, [f"data.prepared_path={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"data.prepared_path '{re.escape(str(tmp_path))}': no manifest.json .*run hymt prepare"):
        build_datasets(cfg)
