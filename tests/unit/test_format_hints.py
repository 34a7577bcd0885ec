"""A corpus file read in the wrong format: the one line that refuses it names the format the file looks like.

Every pairing of what a file holds (a Tatoeba TSV, a 2-column TSV, a CSV, JSON lines, Parquet, one side of a
Moses pair) with each ``format`` it could be given as, through the preflight check ``hymt train`` and
``hymt prepare`` run before Ray starts.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_hymt.config.schema import load_config
from raytrain_hymt.data.preflight import source_problems

KINDS = ("tatoeba", "tsv", "csv", "jsonl", "parquet", "moses")
PAIRS = [("Hallo", "Hello"), ("Danke", "Thank you"), ("Ja", "Yes")]


def write_kind(folder, kind: str) -> str:
    """A small de-en corpus of ``kind`` in ``folder``; the path a source names it by as that kind."""
    if kind == "tatoeba":
        (folder / "t.tsv").write_text("".join(f"deu\teng\t{de}\t{en}\n" for de, en in PAIRS), encoding="utf-8")
        return str(folder / "t.tsv")
    if kind == "tsv":
        (folder / "p.tsv").write_text("".join(f"{de}\t{en}\n" for de, en in PAIRS), encoding="utf-8")
        return str(folder / "p.tsv")
    if kind == "csv":
        (folder / "p.csv").write_text("".join(f"{de},{en}\n" for de, en in PAIRS), encoding="utf-8")
        return str(folder / "p.csv")
    if kind == "jsonl":
        (folder / "p.jsonl").write_text("".join(json.dumps({"src": de, "tgt": en}) + "\n" for de, en in PAIRS),
                                        encoding="utf-8")
        return str(folder / "p.jsonl")
    if kind == "parquet":
        pq.write_table(pa.table({"src": [p[0] for p in PAIRS], "tgt": [p[1] for p in PAIRS]}), folder / "p.parquet")
        return str(folder / "p.parquet")
    (folder / "m.de").write_text("".join(f"{de}\n" for de, _ in PAIRS), encoding="utf-8")
    (folder / "m.en").write_text("".join(f"{en}\n" for _, en in PAIRS), encoding="utf-8")
    return str(folder / "m")


def problems(path: str, fmt: str) -> list[str]:
    source = {"path": path, "format": fmt, "src_lang": "de", "tgt_lang": "en"}
    return source_problems(load_config(None, ["data.sources=" + json.dumps([source])]).data)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_file_passes_as_its_own_format(tmp_path, kind):
    assert problems(write_kind(tmp_path, kind), kind) == []


@pytest.mark.parametrize("kind, fmt", [(k, f) for k in KINDS for f in KINDS if k != f])
def test_a_file_in_the_wrong_format_is_told_the_format_it_looks_like(tmp_path, kind, fmt):
    path = write_kind(tmp_path, kind)
    if kind == "moses":
        path += ".de"  # one side of the pair, as a file
    (problem,) = problems(path, fmt)
    assert problem.startswith("data.sources[0]."), problem
    hint = re.search(r"\(([^()]*)\)$", problem)
    assert hint and f"format '{kind}'" in hint.group(1), problem
    assert problem.count("\n") == 0


def test_the_hints_read_as_documented(tmp_path):
    jsonl = write_kind(tmp_path, "jsonl")
    assert problems(jsonl, "tatoeba") == [
        f"data.sources[0].format: {jsonl}: line 1 is a JSON object, format 'tatoeba' reads tab-separated columns "
        "(JSON lines: format 'jsonl')"]
    parquet = write_kind(tmp_path, "parquet")
    assert problems(parquet, "tsv") == [
        f"data.sources[0].format: {parquet}: it is a Parquet file, not lines of text (format 'parquet' reads it)"]
    side = write_kind(tmp_path, "moses") + ".de"
    assert problems(side, "tsv") == [
        f"data.sources[0].format: {side}: its first 3 lines have 1 tab-separated columns, format 'tsv' needs 2 (one sentence a "
        f"line, like a Moses file: format 'moses' with path '{tmp_path}/m' reads {tmp_path}/m.<src_lang> and "
        f"{tmp_path}/m.<tgt_lang>)"]


@pytest.mark.parametrize("fmt, glob", [("tsv", "*.tsv"), ("tatoeba", "*.tsv"), ("csv", "*.csv"), ("jsonl", "*.jsonl"),
                                       ("parquet", "*.parquet")])
def test_a_folder_given_as_a_corpus_file_is_called_a_folder_with_the_glob_that_reads_it(tmp_path, fmt, glob):
    (tmp_path / "corpus").mkdir()
    assert problems(str(tmp_path / "corpus"), fmt) == [
        f"data.sources[0].path: data source '{tmp_path}/corpus' is a folder, not a file; to read the files in it "
        f"give a glob, e.g. '{tmp_path}/corpus/{glob}'"]
