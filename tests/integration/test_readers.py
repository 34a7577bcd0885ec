"""Every source format, read for real from small files in tmp_path: rows, origins, ids, bad-line rows and
clear errors. The per-file readers are plain generators (tested without Ray); planning and Ray Data
reads (Moses line counts, globs, URIs, Hugging Face folders) use the session's Ray.

Not testable here: ``s3://`` / ``gs://`` URIs (no cloud access; they go through the same pyarrow
filesystem code as the ``file://`` URIs tested below)."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_hymt.config.schema import SourceConfig
from raytrain_hymt.data.files import count_lines, expand_paths
from raytrain_hymt.data.readers import PAIR_COLUMNS, DataSourceError, example_id
from raytrain_hymt.data.sources import plan_source, read_source


def read_all(source: SourceConfig, index: int = 0) -> list[dict]:
    """Rows of every read task of a source, in plan order (no Ray Data involved)."""
    rows = []
    for unit in plan_source(source, index):
        for table in unit.read():
            assert table.column_names == list(PAIR_COLUMNS)
            rows.extend(table.to_pylist())
    return rows


def good(rows):
    return [(r["src"], r["tgt"], r["src_lang"], r["tgt_lang"]) for r in rows if not r["drop_reason"]]


def bad(rows):
    return [(r["origin"], r["drop_reason"], r["src"]) for r in rows if r["drop_reason"]]


def test_tatoeba_rows_origins_ids_and_bad_lines(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_bytes(
        "eng\tcmn_Hans\tHello.\t你好。\n"
        "eng\tcmn_Hans\tonly three columns\n"
        "\n".encode()
        + b"eng\tcmn_Hans\t\xff\xfebad\t\xe5\n"
        + "deu\teng\tHallo \"du\".\tHi, you.\r\n".encode()
    )
    rows = read_all(SourceConfig(path=str(path), format="tatoeba"), index=3)
    assert good(rows) == [("Hello.", "你好。", "eng", "cmn_Hans"), ('Hallo "du".', "Hi, you.", "deu", "eng")]
    assert [r["origin"] for r in rows] == [f"{path}:{n}" for n in (1, 2, 4, 5)]  # line 3 blank: no row
    # ids name the file relative to the source's root (its folder), never by its absolute path
    assert [r["example_id"] for r in rows] == [example_id(3, f"t.tsv:{n}") for n in (1, 2, 4, 5)]
    assert {r["source"] for r in rows} == {3}
    assert bad(rows) == [
        (f"{path}:2", "malformed", "expected 4 tab-separated columns, got 3: eng\tcmn_Hans\tonly three columns"),
        (f"{path}:4", "invalid_utf8", "not valid UTF-8: eng\tcmn_Hans\t\ufffd\ufffdbad\t\ufffd"),
    ]


def test_gzip_and_globs_in_a_fixed_order(tmp_path):
    for name, text in (("b.tsv.gz", "B1\tb1\n"), ("a.tsv", "A1\ta1\nA2\ta2\n")):
        data = text.encode()
        (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    source = SourceConfig(path=str(tmp_path / "*.tsv*"), format="tsv", src_lang="en", tgt_lang="de")
    assert good(read_all(source)) == [("A1", "a1", "en", "de"), ("A2", "a2", "en", "de"), ("B1", "b1", "en", "de")]
    assert count_lines(str(tmp_path / "b.tsv.gz")) == 1


def test_tsv_needs_languages_and_flags_extra_columns(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text("a\tb\nc\td\te\n")
    with pytest.raises(DataSourceError, match=r"x.tsv'.*set src_lang and tgt_lang"):
        plan_source(SourceConfig(path=str(path), format="tsv"), 0)
    rows = read_all(SourceConfig(path=str(path), format="tsv", src_lang="en", tgt_lang="fr"))
    assert good(rows) == [("a", "b", "en", "fr")]
    assert bad(rows) == [(f"{path}:2", "malformed", "expected 2 '\\t'-separated columns, got 3: c\td\te")]


def test_csv_quoting_through_the_csv_module(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text(
        'Hello, world.,"Bonjour, le monde."\n'  # unquoted field with a comma: 3 fields → malformed
        '"Hello, world.","Bonjour, le monde."\n'
        '"He said ""hi"".","Il a dit ""salut""."\n'
        '"two\nlines","deux lignes"\n'
        'one field only\n'
        '"a"b,c\n'
        'last,dernier\n'
    )
    rows = read_all(SourceConfig(path=str(path), format="csv", src_lang="en", tgt_lang="fr"))
    assert good(rows) == [
        ("Hello, world.", "Bonjour, le monde.", "en", "fr"),
        ('He said "hi".', 'Il a dit "salut".', "en", "fr"),
        ("two\nlines", "deux lignes", "en", "fr"),
        ("last", "dernier", "en", "fr"),
    ]
    origins = {r["src"]: r["origin"] for r in rows}
    assert origins["two\nlines"] == f"{path}:4" and origins["last"] == f"{path}:8"  # a record's first line
    assert [(o, r) for o, r, _ in bad(rows)] == [(f"{path}:1", "malformed"), (f"{path}:6", "malformed"), (f"{path}:7", "malformed")]
    assert bad(rows)[0][2].startswith("expected 2 comma-separated fields, got 3")
    assert bad(rows)[2][2].startswith("CSV error: ")


def _jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in lines) + "\n")


def test_jsonl_flat_columns_translation_dicts_and_malformed_lines(tmp_path):
    flat = tmp_path / "flat.jsonl"
    _jsonl(flat, [{"en_text": "Hi.", "zh_text": "嗨。", "id": 1}, {"en_text": "Yes.", "zh_text": None}])
    src = SourceConfig(path=str(flat), format="jsonl", src_lang="en", tgt_lang="zh", src_column="en_text", tgt_column="zh_text")
    assert good(read_all(src)) == [("Hi.", "嗨。", "en", "zh"), ("Yes.", "", "en", "zh")]  # null → "" (cleaning: empty)

    hf = tmp_path / "hf.jsonl"
    _jsonl(hf, [
        {"translation": {"en": "Good.", "zh": "好。"}},
        "{not json",
        [1, 2],
        {"translation": {"en": "No zh."}},
        {"other": 1},
        {"translation": {"en": 5, "zh": "五"}},
    ])
    src = SourceConfig(path=str(hf), format="jsonl", src_lang="en", tgt_lang="zh", src_column="translation", tgt_column="translation")
    rows = read_all(src)
    assert good(rows) == [("Good.", "好。", "en", "zh")]
    problems = [(o.rsplit(":", 1)[1], r, s.split(": ")[0]) for o, r, s in bad(rows)]
    assert [p[:2] for p in problems] == [(str(n), "malformed") for n in (2, 3, 4, 5, 6)]
    messages = [s for _, _, s in bad(rows)]
    assert messages[0].startswith("Expecting property name")
    assert messages[1].startswith("expected a JSON object, got list")
    assert messages[2].startswith("field 'translation' has no key 'zh' (keys: en)")
    assert messages[3].startswith("no field 'translation' (fields: other)")
    assert messages[4].startswith("field 'translation' is int, not text")


def test_parquet_columns_structs_and_schema_errors(tmp_path):
    flat = tmp_path / "flat.parquet"
    pq.write_table(pa.table({"de": ["Hallo.", None], "en": ["Hello.", "Bye."], "n": [1, 2]}), flat)
    src = SourceConfig(path=str(flat), format="parquet", src_lang="de", tgt_lang="en", src_column="de", tgt_column="en")
    rows = read_all(src)
    assert good(rows) == [("Hallo.", "Hello.", "de", "en"), ("", "Bye.", "de", "en")]
    assert [r["origin"] for r in rows] == [f"{flat}:1", f"{flat}:2"]

    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"translation": [{"en": "One.", "fr": "Un."}, {"en": "Two.", "fr": "Deux."}]}), nested)
    src = SourceConfig(path=str(nested), format="parquet", src_lang="fr", tgt_lang="en", src_column="translation", tgt_column="translation")
    assert good(read_all(src)) == [("Un.", "One.", "fr", "en"), ("Deux.", "Two.", "fr", "en")]

    with pytest.raises(DataSourceError, match=r"nested.parquet: column 'translation' has no field 'de' \(fields: en, fr\)"):
        read_all(src.model_copy(update={"src_lang": "de"}))
    with pytest.raises(DataSourceError, match=r"flat.parquet: no column 'src' \(columns: de, en, n\)"):
        read_all(SourceConfig(path=str(flat), format="parquet", src_lang="de", tgt_lang="en"))
    with pytest.raises(DataSourceError, match=r"flat.parquet: column 'n' holds int64, not text"):
        read_all(SourceConfig(path=str(flat), format="parquet", src_lang="de", tgt_lang="en", src_column="n", tgt_column="en"))


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(DataSourceError, match=r"'.*nope.tsv': no such file"):
        plan_source(SourceConfig(path=str(tmp_path / "nope.tsv")), 0)
    with pytest.raises(DataSourceError, match=r"no such file \(or the glob matched nothing\)"):
        expand_paths(f"file://{tmp_path}/*.nothing")
    with pytest.raises(DataSourceError, match=r"Moses source .*: no files .*corpus.en \(or .en.gz\) found"):
        plan_source(SourceConfig(path=str(tmp_path / "corpus"), format="moses", src_lang="en", tgt_lang="zh"), 0)


# ----------------------------------------------------------------------------------------- with Ray


def test_moses_pairs_from_a_glob_with_gzip(ray_session, tmp_path):
    (tmp_path / "a.en").write_text("One.\nTwo.\n\nFour.\n")
    (tmp_path / "a.zh").write_text("一。\n二。\n三。\n四。\n")
    (tmp_path / "b.en.gz").write_bytes(gzip.compress("Five.\n".encode()))
    (tmp_path / "b.zh.gz").write_bytes(gzip.compress("五。\n".encode()))
    source = SourceConfig(path=str(tmp_path / "*"), format="moses", src_lang="en", tgt_lang="zh")
    rows = read_source(source, 1).take_all()
    assert [(r["src"], r["tgt"]) for r in rows] == [("One.", "一。"), ("Two.", "二。"), ("", "三。"), ("Four.", "四。"), ("Five.", "五。")]
    assert [r["origin"] for r in rows][-2:] == [f"{tmp_path}/a.en:4", f"{tmp_path}/b.en.gz:1"]
    assert [r["example_id"] for r in rows] == [example_id(1, f"{f}:{n}") for f, n in
                                               [("a.en", 1), ("a.en", 2), ("a.en", 3), ("a.en", 4), ("b.en.gz", 1)]]


def test_moses_line_count_mismatch_names_both_files_and_counts(ray_session, tmp_path):
    (tmp_path / "c.en").write_text("1\n2\n3\n")
    (tmp_path / "c.zh").write_text("一\n二\n")
    (tmp_path / "d.en").write_text("x\n")
    (tmp_path / "d.zh").write_text("y\n")
    with pytest.raises(DataSourceError, match=rf"not line-aligned: {tmp_path}/c.en has 3 lines but {tmp_path}/c.zh has 2$"):
        read_source(SourceConfig(path=str(tmp_path / "*"), format="moses", src_lang="en", tgt_lang="zh"), 0)
    (tmp_path / "e.en").write_text("lonely\n")
    with pytest.raises(DataSourceError, match=rf"{tmp_path}/e.en has no partner {tmp_path}/e.zh"):
        plan_source(SourceConfig(path=str(tmp_path / "e"), format="moses", src_lang="en", tgt_lang="zh"), 0)


def test_file_uris_for_text_and_parquet(ray_session, tmp_path):
    (tmp_path / "u.tsv").write_text("eng\tdeu\tHouse.\tHaus.\n")
    pq.write_table(pa.table({"src": ["Tree."], "tgt": ["Baum."]}), tmp_path / "u.parquet")
    rows = read_source(SourceConfig(path=f"file://{tmp_path}/u.tsv"), 0).take_all()
    assert [(r["src"], r["tgt"], r["origin"]) for r in rows] == [("House.", "Haus.", f"file://{tmp_path}/u.tsv:1")]
    uri = SourceConfig(path=f"file://{tmp_path}/*.parquet", format="parquet", src_lang="en", tgt_lang="de")
    assert [(r["src"], r["tgt"]) for r in read_source(uri, 0).take_all()] == [("Tree.", "Baum.")]


def test_hf_save_to_disk_folder_with_splits(ray_session, tmp_path):
    import datasets

    features = datasets.Features({"translation": datasets.Translation(languages=["en", "zh"])})
    pairs = [{"en": f"Number {i}.", "zh": f"数字{i}。"} for i in range(5)]
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"translation": pairs[:3]}, features=features),
        "validation": datasets.Dataset.from_dict({"translation": pairs[3:]}, features=features),
    })
    dd.save_to_disk(str(tmp_path / "hf"))
    source = SourceConfig(path=str(tmp_path / "hf"), format="hf_disk", src_lang="en", tgt_lang="zh",
                          src_column="translation", tgt_column="translation", split="validation")
    rows = read_source(source, 0).take_all()
    assert [(r["src"], r["tgt"]) for r in rows] == [("Number 3.", "数字3。"), ("Number 4.", "数字4。")]
    assert rows[0]["origin"].endswith(".arrow:1")
    arrow = rows[0]["origin"].rsplit(":", 1)[0]  # ids name the Arrow file relative to the folder
    assert rows[0]["example_id"] == example_id(0, f"{arrow[len(str(tmp_path / 'hf')) + 1:]}:1")
    assert arrow.startswith(str(tmp_path / "hf") + "/validation/")
    with pytest.raises(DataSourceError, match=r"no split 'test' \(splits: train, validation\)"):
        plan_source(source.model_copy(update={"split": "test"}), 0)


def test_hf_hub_name_through_a_local_cache_and_a_clear_error_offline(ray_session, tmp_path, monkeypatch):
    import datasets

    # A dataset "name" that load_dataset resolves without a network: a local folder of JSON lines,
    # prepared into a fresh cache. (A real hub name cannot be fetched here: no network.)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    repo = tmp_path / "my_corpus"
    repo.mkdir()
    _jsonl(repo / "train.jsonl", [{"en": "Cat.", "de": "Katze."}, {"en": "Dog.", "de": "Hund."}])
    source = SourceConfig(path=str(repo), format="hf_hub", src_lang="en", tgt_lang="de", src_column="en", tgt_column="de")
    rows = read_source(source, 0).take_all()
    assert [(r["src"], r["tgt"]) for r in rows] == [("Cat.", "Katze."), ("Dog.", "Hund.")]
    assert rows[0]["origin"].startswith(str(tmp_path / "cache"))
    # The cache folder is no part of the id: the Arrow file's base name is.
    assert rows[0]["example_id"] == example_id(0, rows[0]["origin"].rsplit("/", 1)[1])

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    missing = SourceConfig(path="nobody-here/no-such-corpus", format="hf_hub", src_lang="en", tgt_lang="de")
    with pytest.raises(DataSourceError, match=r"'nobody-here/no-such-corpus' \(hf_hub\): load_dataset failed: .*HF_DATASETS_CACHE"):
        plan_source(missing, 0)


def test_tatoeba_src_and_tgt_lang_select_the_direction(tmp_path):
    """src_lang/tgt_lang on a Tatoeba file: rows the other way round are swapped, rows of other languages
    are kept as ``other_languages`` drops (counted), an empty label column takes the setting."""
    path = tmp_path / "mixed.tsv"
    path.write_text("eng\tjpn\tGood morning.\tおはよう。\njpn\teng\tありがとう。\tThank you.\n"
                    "eng\tdeu\tThanks.\tDanke.\n\teng\tさようなら。\tGoodbye.\n", encoding="utf-8")
    rows = read_all(SourceConfig(path=str(path), src_lang="ja", tgt_lang="en"))
    assert good(rows) == [("おはよう。", "Good morning.", "jpn", "eng"), ("ありがとう。", "Thank you.", "jpn", "eng"),
                          ("さようなら。", "Goodbye.", "ja", "eng")]
    assert bad(rows) == [(f"{path}:3", "other_languages", "Thanks.")]
    only_target = read_all(SourceConfig(path=str(path), tgt_lang="jpn"))
    assert [(r["src_lang"], r["tgt_lang"]) for r in only_target if not r["drop_reason"]] == [("eng", "jpn")] * 2
    unset = read_all(SourceConfig(path=str(path)))  # the rows' own directions, as labelled
    assert [(r["src_lang"], r["tgt_lang"]) for r in unset] == [("eng", "jpn"), ("jpn", "eng"), ("eng", "deu"), ("", "eng")]
