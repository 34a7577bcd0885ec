"""The whole Ray Data pipeline on real Ray: every cleaning rule counted, dedup, weights, the language
mapping and prompt layout decoded from packed rows, the validation split by source sentence on the real
Tatoeba files, deterministic order, ``hymt prepare`` round trip, and the clear errors.

Pipeline builds are slow-ish (seconds each), so each module fixture builds once and many tests read it.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pytest

from raytrain_hymt.config.schema import load_config
from raytrain_hymt.config.schema import SourceConfig
from raytrain_hymt.data.cleaning import CleaningRules, DataQualityError, normalize_text, pair_key
from raytrain_hymt.data.packing import IGNORE_INDEX
from raytrain_hymt.data.pipeline import (
    TOKENIZED_COLUMNS,
    apply_weights,
    build_datasets,
    finish_partition,
    group_key,
    mark_duplicates,
    order_key,
    prepare_pairs,
)
from raytrain_hymt.data.readers import example_id
from raytrain_hymt.errors import DataSourceError
from raytrain_hymt.languages import UnsupportedLanguageError
from raytrain_hymt.data.files import SAMPLE_CORPUS
from raytrain_hymt.tokenizer import load_tokenizer

from conftest import TATOEBA_DEU_ENG

LONG_EN = "The committee discussed the proposal for several hours before finally agreeing on a compromise today."
LONG_DE = "Der Ausschuss diskutierte den Vorschlag mehrere Stunden, bevor er sich heute auf einen Kompromiss einigte."
# (line text, what happens to it) for the Tatoeba-format source of the mixed corpus.
MIXED_TSV = [
    ("eng\tcmn_Hans\tHello there.\t你好。", "kept"),
    ("eng\tzho_Hant\tGood morning.\t早安。", "kept"),
    ("en-US\tyue_Hant\tThank you.\t多謝。", "kept"),
    ("deu\teng\tDas Haus ist groß.\tThe house is big.", "kept"),
    ("eng\twuu\tHi.\t侬好。", "unsupported_language"),
    ("eng\tcmn_Hans\t\u200b\t你好。", "empty"),
    ("eng\tcmn_Hans\tA\t啊啊", "too_short"),
    ("eng\tcmn_Hans\t" + "x" * 130 + "\t" + "好" * 40, "too_long"),
    ("eng\tcmn_Hans\tThis sentence is quite a lot longer than its translation.\t好。", "length_ratio"),
    ("eng\tdeu\tTom!\ttom!", "identical"),
    ("eng\tcmn_Hans\tHello  there.\t你好。", "duplicate"),  # line 1 after whitespace normalisation
    ("just one column", "malformed"),
    (None, "invalid_utf8"),
    (f"eng\tdeu\t{LONG_EN}\t{LONG_DE}", "too_many_tokens"),
    ("eng\tdeu\tMy grandmother grows tomatoes in her garden.\tMa grand-mère cultive des tomates dans son jardin.",
     "wrong_language"),  # French labelled German
]
N_JSONL = 20


def _config(**data):
    cfg = load_config(None, [])
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def _examples(rows):
    """(example_id, input_ids, labels) of every example in packed rows, split by ``seq_lens``."""
    out = []
    for r in rows:
        starts = np.cumsum([0, *r["seq_lens"]])
        for eid, a, b in zip(r["example_ids"], starts[:-1], starts[1:]):
            out.append((int(eid), r["input_ids"][a:b].tolist(), r["labels"][a:b].tolist()))
    return out


@pytest.fixture(scope="module")
def mixed(ray_session, tmp_path_factory):
    """Three sources (Tatoeba TSV with one line per rule, CSV weight 2, JSONL weight 0.5), both
    directions, no validation split; built once."""
    d = tmp_path_factory.mktemp("mixed")
    tsv = d / "mixed.tsv"
    tsv.write_bytes(b"".join((t.encode() if t else b"eng\tcmn_Hans\t\xff\xfe\t\xe5\xa5") + b"\n" for t, _ in MIXED_TSV))
    (d / "pairs.csv").write_text('"One, two.","一，二。"\nThree.,三。\n')
    (d / "pairs.jsonl").write_text("".join(f'{{"en": "Sentence number {i}.", "zh": "第{i}句。"}}\n' for i in range(N_JSONL)))
    cfg = _config(
        sources=[
            SourceConfig(path=str(tsv), format="tatoeba"),
            SourceConfig(path=str(d / "pairs.csv"), format="csv", src_lang="en", tgt_lang="zh", weight=2),
            SourceConfig(path=str(d / "pairs.jsonl"), format="jsonl", src_lang="en", tgt_lang="zh",
                         src_column="en", tgt_column="zh", weight=0.5),
        ],
        min_chars=2, max_chars=120, max_example_tokens=64, pack_tokens=256, val_fraction=0.0,
        both_directions=True, max_bad_fraction=0.5,
    )
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("raytrain_hymt.data.pipeline").addHandler(handler)
    try:
        train, val, stats = build_datasets(cfg)
    finally:
        logging.getLogger("raytrain_hymt.data.pipeline").removeHandler(handler)
    return {"dir": d, "tsv": str(tsv), "rows": train.take_all(), "val": val.take_all(), "stats": stats, "log": records}


def test_every_cleaning_rule_is_counted(mixed):
    stats = mixed["stats"]
    subsampled = stats.dropped.pop("subsampled")
    assert 0 < subsampled < N_JSONL
    expected = {reason: 1 for _, reason in MIXED_TSV if reason != "kept"}
    expected["too_many_tokens"] = 2  # counted per example: both directions are too long
    assert stats.dropped == expected
    assert stats.rows_read == len(MIXED_TSV) + 2 + N_JSONL
    kept_pairs = 4 + 2 * 2 + (N_JSONL - subsampled)  # Tatoeba lines kept, CSV twice, JSONL sampled
    assert stats.train_examples == 2 * kept_pairs  # both directions
    assert len(_examples(mixed["rows"])) == stats.train_examples
    assert stats.val_examples == stats.val_rows == 0 and mixed["val"] == []
    assert stats.train_rows == len(mixed["rows"])
    assert stats.train_tokens == sum(len(r["input_ids"]) for r in mixed["rows"])
    assert stats.train_target_tokens == sum(int((r["labels"] != IGNORE_INDEX).sum()) for r in mixed["rows"])


def test_bad_lines_are_logged_with_their_origin(mixed):
    [message] = [m for m in mixed["log"] if "could not be parsed" in m]
    tsv = mixed["tsv"]
    assert message.startswith(f"2 of {mixed['stats'].rows_read} rows could not be parsed")
    assert f"{tsv}:12: malformed: 'expected 4 tab-separated columns, got 1: just one column'" in message
    assert f"{tsv}:13: invalid_utf8: 'not valid UTF-8: " in message


def test_kept_rows_dedup_and_weights(mixed):
    ids = [eid for eid, _, _ in _examples(mixed["rows"])]
    line = {n: example_id(0, f"mixed.tsv:{n}") for n in range(1, len(MIXED_TSV) + 1)}
    # The duplicate pair keeps the smaller example_id of its two lines; every other dropped line is gone.
    kept_dup, dropped_dup = sorted([line[1], line[11]])
    expected_tsv = {line[n] for n in (2, 3, 4)} | {kept_dup}
    assert {e for e in ids if e in line.values()} == expected_tsv and dropped_dup not in ids
    csv_ids = {example_id(1, f"pairs.csv:{n}") for n in (1, 2)}
    assert csv_ids <= set(ids)
    assert all(ids.count(e) == 2 for e in set(ids))  # each example once per direction, copies get new ids
    assert len(set(ids)) == 4 + 4 + (len(ids) // 2 - 8)


def test_language_mapping_and_prompt_layout_in_packed_rows(mixed):
    tok = load_tokenizer("tiny")
    by_id: dict[int, list[tuple[str, str]]] = {}
    for eid, ids, labels in _examples(mixed["rows"]):
        assert labels[0] == IGNORE_INDEX
        n_prompt = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
        assert labels[n_prompt:] == ids[n_prompt:]  # loss on the whole answer and its end of turn
        by_id.setdefault(eid, []).append((tok.decode(ids[:n_prompt]), tok.decode(ids[n_prompt:])))
    zh = "<|startoftext|>把下面的文本翻译成{}，不要额外解释。\n\n{}<|extra_0|>"
    en = "<|startoftext|>Translate the following segment into {}, without additional explanation.\n\n{}<|extra_0|>"
    assert sorted(by_id[example_id(0, "mixed.tsv:2")]) == sorted([
        (zh.format("繁体中文", "Good morning."), "早安。<|eos|>"),  # zho_Hant → zh-Hant
        (zh.format("英语", "早安。"), "Good morning.<|eos|>"),
    ])
    assert sorted(by_id[example_id(0, "mixed.tsv:3")]) == sorted([
        (zh.format("粤语", "Thank you."), "多謝。<|eos|>"),  # en-US → en, yue_Hant → yue
        (zh.format("英语", "多謝。"), "Thank you.<|eos|>"),
    ])
    assert sorted(by_id[example_id(0, "mixed.tsv:4")]) == sorted([
        (en.format("English", "Das Haus ist groß."), "The house is big.<|eos|>"),  # deu → de: English template
        (en.format("German", "The house is big."), "Das Haus ist groß.<|eos|>"),
    ])


# ------------------------------------------------------------------ real Tatoeba files, split and order


@pytest.fixture(scope="module")
def tatoeba(ray_session, tmp_path_factory):
    """eng-zho (the bundled sample) + deu-eng (tests/assets) with a 20% validation split; built once, then
    prepared to Parquet (a second pipeline run) and read back through ``data.prepared_path``."""
    from raytrain_hymt.driver.train import prepare_dataset

    files = [SAMPLE_CORPUS, TATOEBA_DEU_ENG]
    cfg = _config(sources=[SourceConfig(path=str(f), format="tatoeba") for f in files],
                  val_fraction=0.2, max_val_examples=100_000, seed=7)
    train, val, stats = build_datasets(cfg)
    out = tmp_path_factory.mktemp("prepared") / "ds"
    prepared_stats = prepare_dataset(cfg, str(out))
    cfg2 = cfg.model_copy(deep=True)
    cfg2.data.prepared_path = str(out)
    p_train, p_val, p_stats = build_datasets(cfg2)
    return {
        "files": files, "cfg": cfg, "out": out, "stats": stats, "prepared_stats": prepared_stats, "p_stats": p_stats,
        "train": train.take_all(), "val": val.take_all(), "p_train": p_train.take_all(), "p_val": p_val.take_all(),
    }


def _source_of(files) -> dict[int, str]:
    out = {}
    for index, path in enumerate(files):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            out[example_id(index, f"{path.name}:{n}")] = normalize_text(line.split("\t")[2])
    return out


def test_validation_split_is_by_source_sentence(tatoeba):
    src = _source_of(tatoeba["files"])
    train = {src[e] for e, _, _ in _examples(tatoeba["train"])}
    val_ids = [e for e, _, _ in _examples(tatoeba["val"])]
    val = {src[e] for e in val_ids}
    assert not train & val
    # The real file repeats sources with other translations: some of those must sit in validation.
    repeated_in_val = {s for s in val if sum(1 for e in val_ids if src[e] == s) > 1}
    assert len(repeated_in_val) >= 5
    n = tatoeba["stats"].train_examples + tatoeba["stats"].val_examples
    assert 0.17 < tatoeba["stats"].val_examples / n < 0.23


def test_same_seed_same_rows_in_the_same_order_and_prepared_round_trip(tatoeba):
    def same(a, b):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x.keys() == y.keys()
            for k in x:
                assert np.array_equal(np.asarray(x[k]), np.asarray(y[k])), k

    # prepare ran the whole pipeline a second time: identical rows and order prove determinism, and
    # reading them back through data.prepared_path proves the Parquet round trip.
    same(tatoeba["train"], tatoeba["p_train"])
    same(tatoeba["val"], tatoeba["p_val"])
    assert set(tatoeba["train"][0]) == {"input_ids", "labels", "position_ids", "seq_lens", "example_ids", "num_target_tokens"}
    assert tatoeba["stats"] == tatoeba["prepared_stats"] == tatoeba["p_stats"]
    assert (tatoeba["out"] / "stats.json").exists()


def test_prepared_files_are_read_back_in_file_order_where_ray_read_parquet_reorders_them(ray_session, tmp_path, monkeypatch):
    """Ray 2.60's ``read_parquet`` bin-packs files into read tasks (first or best fit); with its default
    128 MiB bins it packs a prepared dataset's small files in the order their footers come back from an
    actor pool, which once reordered the round trip above in CI. A smaller bin (the packing runs on
    the driver) makes the reordering certain."""
    import pyarrow.parquet as pq

    from raytrain_hymt.data.prepared import read_parquet_in_order

    paths = []
    for i, n in enumerate([6000, 6000, 1000]):
        paths.append(str(tmp_path / f"f{i}.parquet"))
        pq.write_table(pa.table({"file": np.full(n, i), "x": np.arange(n, dtype=np.float64)}), paths[-1],
                       compression="none")
    monkeypatch.setenv("RAY_DATA_PARQUET_BIN_PACKING_BYTES", "80000")

    def files_in_row_order(ds):
        return list(dict.fromkeys(ds.to_pandas()["file"].tolist()))

    # The hazard ([1, 0, 2] on the session's cluster, [0, 2, 1] on a 4-CPU one): if this fails, Ray's reader
    # keeps the files' order again and read_parquet_in_order could go.
    assert files_in_row_order(ray_session.data.read_parquet(paths, shuffle=None)) != [0, 1, 2]
    ds = read_parquet_in_order(paths)
    assert files_in_row_order(ds) == [0, 1, 2]
    assert ds.to_pandas()["x"].tolist() == [float(x) for n in (6000, 6000, 1000) for x in range(n)]


def test_prepared_dataset_refuses_another_tokenizer_layout(tatoeba):
    cfg = tatoeba["cfg"].model_copy(deep=True)
    cfg.data.prepared_path = str(tatoeba["out"])
    cfg.data.pack_tokens = 512
    with pytest.raises(DataSourceError, match=r"does not match this config \(pack_tokens: prepared with 1024, configured 512\)"):
        build_datasets(cfg)


def test_every_training_example_appears_once(tatoeba):
    ids = [e for e, _, _ in _examples(tatoeba["train"])]
    assert len(set(ids)) == len(ids) == tatoeba["stats"].train_examples


# ------------------------------------------------------------------ errors of whole corpora


def test_too_many_bad_lines_fail_with_examples(ray_session, tmp_path):
    path = tmp_path / "wrong.csv"
    path.write_text("a,b\nc,d\neng\tcmn_Hans\tHi.\t嗨。\n")  # a CSV read as Tatoeba TSV
    with pytest.raises(DataQualityError, match=r"(?s)2 of 3 rows are bad.*data.max_bad_fraction.*wrong.csv:1: malformed"):
        build_datasets(_config(sources=[SourceConfig(path=str(path), format="tatoeba")]))


def test_empty_file_and_unsupported_language_errors(ray_session, tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n")
    with pytest.raises(DataSourceError, match=r"empty.tsv'\) hold no rows"):
        build_datasets(_config(sources=[SourceConfig(path=str(empty), format="tatoeba")]))
    wuu = tmp_path / "wuu.tsv"
    wuu.write_text("eng\twuu\tHi.\t侬好。\n")
    with pytest.raises(UnsupportedLanguageError, match=r"wuu.tsv:1: language label 'wuu' is not a Hunyuan-MT language"):
        build_datasets(_config(sources=[SourceConfig(path=str(wuu), format="tatoeba")], on_unsupported_language="error"))


# ------------------------------------------------------------------ pure stages


def test_mark_duplicates_keeps_the_smallest_example_id_whatever_the_order():
    batch = {
        "pair_key": np.array(["k1", "k2", "k1", "", "k1"], dtype=object),
        "example_id": np.array([5, 1, -3, -9, 7], dtype=np.int64),
        "drop_reason": np.array(["", "", "", "empty", ""], dtype=object),
    }
    assert mark_duplicates(batch)["drop_reason"].tolist() == ["duplicate", "", "", "empty", "duplicate"]


def test_apply_weights_repeats_and_subsamples_deterministically():
    n = 200
    batch = {
        "example_id": np.arange(n, dtype=np.int64),
        "source": np.array([0] * (n // 2) + [1] * (n // 2), dtype=np.int32),
        "drop_reason": np.array(["malformed", "too_many_tokens"] + [""] * (n - 2), dtype=object),
    }
    out = apply_weights(dict(batch), weights=[3.0, 0.5], seed=1)
    again = apply_weights(dict(batch), weights=[3.0, 0.5], seed=1)
    assert all(np.array_equal(out[k], again[k]) for k in out)
    first = batch["source"][out["index"]] == 0
    assert int(first.sum()) == 1 + 3 * 99  # the malformed row stays single, to be counted once
    # A too-long pair is weighted like a kept one: too_many_tokens counts every example it would make.
    assert out["drop_reason"][first].tolist() == ["malformed"] + ["too_many_tokens"] * 3 + [""] * 3 * 98
    assert out["copy"][first].tolist()[:7] == [0, 0, 1, 2, 0, 1, 2]
    assert len(set(out["example_id"][first].tolist())) == int(first.sum())  # copies get their own ids
    assert out["example_id"][0] == 0 and out["example_id"][1] == 1  # originals keep theirs
    sampled = out["drop_reason"][~first]
    assert 30 < int((sampled == "subsampled").sum()) < 70 and len(sampled) == n // 2
    assert set(sampled.tolist()) == {"", "subsampled"} and set(out["copy"][~first].tolist()) == {0}


def test_group_key_is_seeded_and_equal_for_equal_pairs():
    keys = np.array(["k1", "k2", "k1", ""], dtype=object)
    ids = np.array([10, 11, 12, 13], dtype=np.int64)
    g = group_key(keys, ids, seed=0)
    assert g.dtype == np.int64 and g[0] == g[2] != g[1]
    assert g[3] == 13  # no pair key (dropped in cleaning): spread by the example id
    assert (group_key(keys, ids, seed=1)[:3] != g[:3]).all()
    assert group_key(keys, ids, seed=0).tolist() == g.tolist()


def test_prepare_pairs_cleans_keys_splits_and_reverses():
    batch = {
        "src": np.array(["Hello  there.", "x", "Bad line"], dtype=object),
        "tgt": np.array(["你好。", "y", ""], dtype=object),
        "src_lang": np.array(["eng", "eng", ""], dtype=object),
        "tgt_lang": np.array(["cmn_Hans", "deu", ""], dtype=object),
        "origin": np.array(["f:1", "f:2", "f:3"], dtype=object),
        "example_id": np.array([7, 8, 9], dtype=np.int64),
        "source": np.array([0, 0, 0], dtype=np.int32),
        "drop_reason": np.array(["", "", "malformed"], dtype=object),
    }
    out = prepare_pairs(batch, CleaningRules(min_chars=2), seed=0, val_fraction=0.0, both=True)
    key = pair_key("Hello there.", "你好。", "en", "zh")
    assert out["example_id"].tolist() == [7, 8, 9, 7]
    assert out["direction"].tolist() == [0, 0, 0, 1]
    assert out["src"].tolist() == ["Hello there.", "x", "Bad line", "你好。"]
    assert out["src_lang"].tolist() == ["en", "en", "", "zh"]
    assert out["drop_reason"].tolist() == ["", "too_short", "malformed", ""]
    # The reversed row shares its pair's sort key (same partition), not its dedup key.
    assert out["pair_key"].tolist() == [key, "", "", key + "|reversed"]
    assert out["group_key"].tolist() == [*group_key(np.array([key, "", ""], dtype=object), np.array([7, 8, 9]), 0), out["group_key"][0]]
    assert out["is_val"].tolist() == [False] * 4
    assert out["sample"].tolist() == ["", "", "f:3: malformed: 'Bad line'", ""]
    assert "origin" not in out


def test_finish_partition_dedups_weights_and_orders():
    def tokens(*rows):
        return pa.array([list(r) for r in rows], pa.list_(pa.int32()))

    # Rows 0 and 1: one pair twice (row 1 has the smaller id, so row 0 is the duplicate); row 2 row 1's
    # reverse; row 3 dropped in cleaning; row 4 too long, from a source of weight 2.
    table = pa.table({
        "input_ids": tokens([1, 2], [1, 2], [3, 4, 5], [], []),
        "labels": tokens([-100, 2], [-100, 2], [-100, 4, 5], [], []),
        "example_id": pa.array([5, 4, 4, 9, 6], pa.int64()),
        "source": pa.array([0, 0, 0, 0, 1], pa.int32()),
        "direction": pa.array([0, 0, 1, 0, 0], pa.int8()),
        "num_tokens": pa.array([2, 2, 3, 0, 0], pa.int32()),
        "num_targets": pa.array([1, 1, 2, 0, 0], pa.int32()),
        "drop_reason": ["", "", "", "empty", "too_many_tokens"],
        "is_val": [False] * 5,
        "sample": [""] * 5,
        "pair_key": ["k", "k", "k|reversed", "", "t"],
        "group_key": pa.array([1, 1, 1, 9, 2], pa.int64()),
    })
    out = finish_partition(table, weights=[1.0, 2.0], seed=3)
    assert out.column_names == list(TOKENIZED_COLUMNS)
    from raytrain_hymt.data.pipeline import _hash64

    copy_id = _hash64("6|copy|1")
    rows = {(5, 0): ([1, 2], "duplicate", True), (4, 0): ([1, 2], "", True), (4, 1): ([3, 4, 5], "", False),
            (9, 0): ([], "empty", True), (6, 0): ([], "too_many_tokens", True), (copy_id, 0): ([], "too_many_tokens", False)}
    ids = np.array([e for e, _ in rows], dtype=np.int64)
    directions = np.array([d for _, d in rows], dtype=np.int8)
    expected = [list(rows)[i] for i in np.argsort(order_key(ids, directions, seed=3))]
    assert out["example_id"].to_pylist() == [e for e, _ in expected]
    assert out["input_ids"].to_pylist() == [rows[k][0] for k in expected]
    assert out["drop_reason"].to_pylist() == [rows[k][1] for k in expected]
    assert out["primary"].to_pylist() == [rows[k][2] for k in expected]
    assert finish_partition(table, weights=[1.0, 2.0], seed=3).equals(out)
    # Without dedup the duplicate is kept; the reversed row is never compared with the forward pair.
    assert finish_partition(table, weights=[1.0, 2.0], seed=3, dedup=False)["drop_reason"].to_pylist().count("duplicate") == 0


def test_pyarrow_threaded_write_may_reorder_the_blocks_of_one_file(tmp_path):
    """Why prepared rows are not written with ``Dataset.write_parquet``: Ray 2.60's Parquet sink hands the
    blocks of one write task to ``pyarrow.dataset.write_dataset`` with ``use_threads=True`` and without
    ``preserve_order``, and pyarrow's threads may then write them in another order (about one write in
    three of these 16 small tables on an idle 2-core machine, one in thirteen on a busy one; never with one
    CPU thread, so the test gives pyarrow two). If this stops failing in 200 tries, pyarrow keeps the order
    again; the prepared writer (one file a block, numbered in stream order) is ordered either way."""
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    tables = [pa.table({"x": np.arange(4 * i, 4 * i + 4)}) for i in range(16)]

    def written(trial: int) -> list[int]:
        folder = tmp_path / str(trial)
        pads.write_dataset(tables, folder, format="parquet", basename_template="f-{i}.parquet", use_threads=True,
                           min_rows_per_group=4, max_rows_per_group=4)  # the sink's call, for row groups of 4
        return pq.read_table(folder / "f-0.parquet")["x"].to_pylist()

    threads = pa.cpu_count()
    pa.set_cpu_count(max(2, threads))
    try:
        assert any(written(trial) != list(range(64)) for trial in range(200))
    finally:
        pa.set_cpu_count(threads)


def test_prepared_files_are_the_blocks_of_the_stream_in_order(tatoeba):
    """hymt prepare writes block n of the ordered stream as file n, one row group of one lane each: the
    file order is the row order by construction."""
    import json

    from raytrain_hymt.data.epochs import block_rows
    from raytrain_hymt.data.prepared import row_groups

    files = json.loads((tatoeba["out"] / "manifest.json").read_text())["files"]["train"]
    assert len(files) > 1 and [f.rsplit("/", 1)[1] for f in files] == [f"{n:06}.parquet" for n in range(len(files))]
    _, groups, rows = row_groups(str(tatoeba["out"]), "train")
    lane = block_rows(tatoeba["cfg"], tatoeba["stats"])
    assert groups == [(n, 0) for n in range(len(files))]
    assert rows[:-1] == [lane] * (len(rows) - 1) and 0 < rows[-1] <= lane and sum(rows) == tatoeba["stats"].train_rows


def test_pool_actors_are_never_restarted_and_ray_still_takes_max_restarts_only_as_a_deprecated_remote_arg(
        ray_session, tmp_path):
    """``map_on_actors`` (the tokenizer pool, evaluation's replicas): an actor that dies fails the
    execution; Ray Data's default would restart it and hand it the batch again. Ray 2.60.0 takes
    ``max_restarts`` only through ``map_batches``' deprecated ``**ray_remote_args``: once Ray names it
    (or drops the remote args), this fails, and map_on_actors should pass the named option instead."""
    import inspect
    import warnings

    from ray.data import ActorPoolStrategy, Dataset
    from ray.util.annotations import RayDeprecationWarning

    from raytrain_hymt.data.pipeline import map_on_actors

    class DiesOnItsFirstBatch:
        """A pool actor whose process dies on the first batch any actor of its pool is handed (a marker
        file says it happened), and which passes every later batch through. (Defined here: Ray pickles
        it by value, the workers cannot import a test module.)"""

        def __init__(self, marker: str):
            self.marker = marker

        def __call__(self, batch):
            import os

            if not os.path.exists(self.marker):
                open(self.marker, "w").close()
                os._exit(1)
            return batch


    named = set(inspect.signature(Dataset.map_batches).parameters) | set(inspect.signature(ActorPoolStrategy).parameters)
    assert not {"max_restarts", "max_actor_restarts"} & named, "Ray names max_restarts now: use it in map_on_actors"
    assert "ray_remote_args" in inspect.signature(Dataset.map_batches).parameters
    ds = ray_session.data.from_items([{"x": i} for i in range(8)])
    with pytest.warns(RayDeprecationWarning, match="`ray_remote_args` is deprecated"):
        ds.map_batches(DiesOnItsFirstBatch, compute=ActorPoolStrategy(size=1), max_restarts=0,
                       fn_constructor_kwargs={"marker": str(tmp_path / "unused")})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # map_on_actors hides that one warning, and only that one
        pool = map_on_actors(ds, DiesOnItsFirstBatch, 1, batch_size=4,
                             fn_constructor_kwargs={"marker": str(tmp_path / "never-restarted")})
    with pytest.raises(Exception) as failed:
        pool.take_all()
    chain, exc = [], failed.value
    while exc is not None and len(chain) < 20:
        chain.append(exc)
        exc = getattr(exc, "cause", None) or exc.__cause__
    assert any(isinstance(e, ray_session.exceptions.ActorDiedError) for e in chain) or "ActorDiedError" in str(
        failed.value), repr(failed.value)
    # Ray Data's own default restarts the actor, and the same rows come through.
    restarted = ds.map_batches(DiesOnItsFirstBatch, compute=ActorPoolStrategy(size=1), batch_size=4,
                               fn_constructor_kwargs={"marker": str(tmp_path / "restarted")})
    assert sorted(r["x"] for r in restarted.take_all()) == list(range(8))


def test_iter_internal_ref_bundles_hands_out_whole_blocks_in_order(ray_session):
    """What data.blocks and data.prepared rely on in ``Dataset.iter_internal_ref_bundles``, a DeveloperAPI
    with no public equivalent in Ray 2.60.0: no arguments; bundles whose ``blocks`` are whole blocks (no
    slices), each with an object ``ref`` and ``metadata.num_rows`` (an int, the block's rows); in the
    dataset's row order; for a materialized dataset and for a streamed one cut with
    ``repartition(strict=True)`` (as write_prepared streams it)."""
    import inspect

    from ray import ObjectRef
    from ray.data import Dataset
    from ray.data.block import BlockAccessor, BlockMetadata

    assert list(inspect.signature(Dataset.iter_internal_ref_bundles).parameters) == ["self"]
    ctx = ray_session.data.DataContext.get_current()
    preserve, ctx.execution_options.preserve_order = ctx.execution_options.preserve_order, True
    try:
        source = ray_session.data.range(100, override_num_blocks=7).map_batches(lambda b: b, batch_size=None)
        for ds in (source.materialize(), source.repartition(target_num_rows_per_block=16, strict=True)):
            rows, blocks = [], 0
            for bundle in ds.iter_internal_ref_bundles():
                assert all(s is None for s in bundle.slices), "a bundle of block slices: blocks.py counts whole blocks"
                for entry in bundle.blocks:
                    assert isinstance(entry.ref, ObjectRef) and isinstance(entry.metadata, BlockMetadata)
                    assert isinstance(entry.metadata.num_rows, int)
                    block = BlockAccessor.for_block(ray_session.get(entry.ref))
                    assert block.num_rows() == entry.metadata.num_rows
                    rows += block.to_arrow()["id"].to_pylist()
                    blocks += 1
            assert rows == list(range(100)) and blocks > 1
    finally:
        ctx.execution_options.preserve_order = preserve
