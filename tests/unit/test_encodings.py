"""Corpora in GBK, Shift-JIS, EUC-KR, Big5, UTF-16 and cp1252: the encoding guess, the readers decoding in
a source's ``encoding``, preflight's one line naming the file, line and likely encoding, and ``hymt
translate``'s input. The texts are real sentences: FLORES-200 devtest lines (tests/assets/flores200) for
Japanese, Chinese, English and German; Korean and Traditional Chinese sentences written for these tests."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from raytrain_hymt.config.schema import SourceConfig, load_config
from raytrain_hymt.data.files import count_lines, decode_problem, decoded_lines, file_name, guess_encoding
from raytrain_hymt.data.preflight import source_problems
from raytrain_hymt.data.readers import (Columns, delimited_parser, read_csv, read_jsonl, read_line_tables,
                                        read_moses, tatoeba_parser)
from raytrain_hymt.data.sources import plan_source
from raytrain_hymt.driver.translate import read_input
from raytrain_hymt.errors import ConfigError

FLORES = Path(__file__).resolve().parents[1] / "assets" / "flores200" / "devtest"
KOREAN = ["오늘은 날씨가 정말 좋네요.", "저는 매일 아침 학교에 걸어갑니다.", "이 책은 아주 재미있어요.",
          "한국어를 배우는 것은 어렵지만 즐겁습니다."]
TRADITIONAL = ["我們明天早上去圖書館看書。", "這家餐廳的麵條非常好吃。", "臺灣的夏天又熱又潮濕。"]


def flores(code: str, encoding: str = "utf-8", n: int = 20) -> list[str]:
    """The first ``n`` FLORES lines of a language that ``encoding`` can write (a few use characters,
    such as the wave dash, that Shift-JIS lacks)."""
    lines = (FLORES / f"{code}.devtest").read_text(encoding="utf-8").split("\n")
    return [line for line in lines if line and _writable(line, encoding)][:n]


def _writable(text: str, encoding: str) -> bool:
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        return False
    return True


def moses_pair(n: int = 20) -> tuple[list[str], list[str]]:
    """``n`` aligned FLORES English/Japanese lines whose English is ASCII and whose Japanese Shift-JIS writes."""
    en = (FLORES / "eng_Latn.devtest").read_text(encoding="utf-8").split("\n")
    ja = (FLORES / "jpn_Jpan.devtest").read_text(encoding="utf-8").split("\n")
    pairs = [(e, j) for e, j in zip(en, ja) if e.isascii() and _writable(j, "shift_jis")][:n]
    return [e for e, _ in pairs], [j for _, j in pairs]


def text(lines: list[str], encoding: str) -> bytes:
    return "".join(f"{line}\n" for line in lines).encode(encoding)


# ---- the guess ------------------------------------------------------------------------------------

@pytest.mark.parametrize("lines, written, languages, guess", [
    (flores("jpn_Jpan", "shift_jis"), "shift_jis", ("ja",), "shift_jis"),
    (flores("jpn_Jpan", "euc_jp"), "euc_jp", ("ja",), "euc_jp"),
    (flores("jpn_Jpan"), "utf-16", ("ja",), "utf-16"),  # with its byte order mark
    (flores("zho_Hans", "gbk"), "gbk", ("zh",), "gb18030"),
    (flores("zho_Hans"), "utf-16-be", ("en", "zh"), "utf-16-be"),  # no byte order mark
    (flores("eng_Latn"), "utf-16-le", ("en",), "utf-16-le"),  # no byte order mark: NUL bytes
    (TRADITIONAL, "big5", ("zh-Hant",), "big5"),
    (KOREAN, "euc-kr", ("ko",), "euc-kr"),
    (flores("deu_Latn", "cp1252"), "cp1252", ("de",), "cp1252"),
    # Shift-JIS and EUC-KR text, each read by its own language's hint with English beside it (a tsv's two sides).
    (flores("jpn_Jpan", "shift_jis"), "shift_jis", ("en", "ja"), "shift_jis"),
    (KOREAN, "euc-kr", ("en", "ko"), "euc-kr"),
])
def test_the_guess_names_the_encoding_real_text_is_in(lines, written, languages, guess):
    assert guess_encoding(text(lines, written), languages) == guess


def test_japanese_needs_kana_so_gbk_reading_shift_jis_is_no_guess():
    """GBK decodes almost any Shift-JIS bytes, into Han characters only: without the language that is
    what the first common encoding gives; with Japanese, kana decide."""
    sjis = text(flores("jpn_Jpan", "shift_jis"), "shift_jis")
    assert guess_encoding(sjis) == "gb18030"
    assert guess_encoding(sjis, ("ja",)) == "shift_jis"
    assert guess_encoding(text(flores("zho_Hans", "gbk"), "gbk"), ("ko",)) is None  # no reading gives Hangul


def test_the_problem_names_line_column_byte_and_guess():
    _, ja = moses_pair()
    sjis = text(ja, "shift_jis")
    problem = decode_problem(sjis, "utf-8", ("ja",), complete=True)
    assert problem.describe("c.ja", "set encoding: {}") == (
        "c.ja line 1 is not valid utf-8 (byte 0x81 at column 1); it reads as shift_jis: set encoding: shift_jis")
    # A bad byte later in a file: its own line and column (characters before it, plus one).
    later = "Hello.\nHallo, wie geht's?\n".encode() + "Größe\n".encode("cp1252")
    assert decode_problem(later, "utf-8", ("de",), complete=True).describe("x.de", "set encoding: {}") == (
        "x.de line 3 is not valid utf-8 (byte 0xf6 at column 3); it reads as cp1252: set encoding: cp1252")
    # UTF-16 English is valid UTF-8 byte for byte, but full of NUL bytes.
    utf16 = text(flores("eng_Latn", n=2), "utf-16-le")
    assert decode_problem(utf16, "utf-8", ("en",), complete=True).describe("e.en", "add --encoding {}") == (
        "e.en line 1 is not utf-8 text (NUL byte at column 2, as in UTF-16); it reads as utf-16-le: "
        "add --encoding utf-16-le")
    # No reading gives Japanese: every encoding tried is named.
    german = text(flores("deu_Latn", "cp1252", n=3), "cp1252")
    assert decode_problem(german, "utf-8", ("ja",), complete=True).describe("g.ja", "set encoding: {}") == (
        "g.ja line 1 is not valid utf-8 (byte 0x84 at column 1), and reads as Japanese text in none of utf-8, "
        "shift_jis, cp932, euc_jp, gb18030, euc-kr, big5, utf-16-le, utf-16-be, cp1252, latin-1: "
        "set encoding: <its encoding>")
    assert decode_problem(sjis, "shift_jis", ("ja",), complete=True) is None


def test_a_cut_off_character_at_the_end_of_a_files_start_is_no_problem():
    sjis = text(flores("jpn_Jpan", "shift_jis"), "shift_jis")
    cut = sjis[:sjis.index(b"\n") + 2]  # the next line's first character is cut in two
    assert decode_problem(cut, "shift_jis", ("ja",), complete=False) is None
    assert decode_problem(cut, "shift_jis", ("ja",), complete=True).line == 2


# ---- the readers ----------------------------------------------------------------------------------

def test_text_formats_decode_in_the_sources_encoding(tmp_path):
    zh, en = flores("zho_Hans", "gbk", 3), flores("eng_Latn", n=3)
    tsv = tmp_path / "gbk.tsv"
    tsv.write_bytes(text([f"{e}\t{z}" for e, z in zip(en, zh)], "gbk"))
    (table,) = read_line_tables(str(tsv), 0, delimited_parser("\t", "en", "zh"), file_name(str(tsv), str(tmp_path)),
                                "gbk")
    assert table.column("tgt").to_pylist() == zh and set(table.column("drop_reason").to_pylist()) == {""}

    ja = flores("jpn_Jpan", "shift_jis", 2)
    csv_file = tmp_path / "sjis.csv"
    rows = io.StringIO()
    csv.writer(rows, lineterminator="\n").writerows(zip(ja, en))
    csv_file.write_bytes(rows.getvalue().encode("shift_jis"))
    (table,) = read_csv(str(csv_file), 0, "ja", "en", file_name(str(csv_file), str(tmp_path)), "shift_jis")
    assert table.column("src").to_pylist() == ja and table.column("tgt").to_pylist() == en[:2]

    jsonl = tmp_path / "ko.jsonl"
    jsonl.write_bytes(text([json.dumps({"src": k, "tgt": e}, ensure_ascii=False) for k, e in zip(KOREAN, en)],
                           "euc-kr"))
    (table,) = read_jsonl(str(jsonl), 0, Columns("src", "tgt", "ko", "en"), file_name(str(jsonl), str(tmp_path)),
                          "euc-kr")
    assert table.column("src").to_pylist() == KOREAN[:3]

    # UTF-16 with its byte order mark: the first language label is "jpn", not "\ufeffjpn".
    tatoeba = tmp_path / "utf16.tsv"
    tatoeba.write_bytes(text([f"jpn\teng\t{j}\t{e}" for j, e in zip(ja, en)], "utf-16"))
    (table,) = read_line_tables(str(tatoeba), 0, tatoeba_parser(None, None), file_name(str(tatoeba), str(tmp_path)),
                                "utf-16")
    assert table.column("src_lang").to_pylist() == ["jpn", "jpn"] and table.column("src").to_pylist() == ja


def test_a_line_that_does_not_decode_is_counted_in_its_encodings_name(tmp_path):
    path = tmp_path / "mixed.tsv"
    zh = flores("zho_Hans", "gbk", 2)
    path.write_bytes(f"a\t{zh[0]}\n".encode("gbk") + "b\t日本語\n".encode("utf-8")[:-3] + b"\xff\n"
                     + f"c\t{zh[1]}\n".encode("gbk"))
    (table,) = read_line_tables(str(path), 0, delimited_parser("\t", "en", "zh"), file_name(str(path), str(tmp_path)),
                                "gbk")
    rows = table.to_pylist()
    assert [r["drop_reason"] for r in rows] == ["", "invalid_utf8", ""]
    assert rows[1]["origin"] == f"{path}:2" and rows[1]["src"].startswith("not valid gbk: b\t")
    assert [r["tgt"] for r in rows if not r["drop_reason"]] == zh


def test_utf16_lines_are_counted_and_read_as_text(tmp_path):
    """In UTF-16 byte 0x0A is also half of other characters (上 is 0A 4E): lines are counted as text."""
    lines = ["上", "上海", "Hello"]
    path = tmp_path / "c.zh"
    path.write_bytes(text(lines, "utf-16-le"))
    assert path.read_bytes().count(b"\n") == 5  # 3 line ends and 2 halves of 上
    assert count_lines(str(path), "utf-16-le") == 3
    assert [(n, line, ok) for n, line, ok in decoded_lines(str(path), "utf-16-le")] == [
        (1, "上", True), (2, "上海", True), (3, "Hello", True)]
    path.write_bytes(text(lines, "utf-16-le")[:-2] + b"\x00\xdc\n\x00")  # a lone low surrogate before the last line end
    assert list(decoded_lines(str(path), "utf-16-le"))[-1] == (3, "Hello\ufffd", False)


def test_a_bad_moses_row_names_the_file_whose_side_is_bad(tmp_path):
    en, ja = moses_pair(3)
    (tmp_path / "c.en").write_text("".join(f"{line}\n" for line in en), encoding="utf-8")
    (tmp_path / "c.ja").write_bytes(text(ja, "shift_jis"))
    src, tgt = str(tmp_path / "c.en"), str(tmp_path / "c.ja")
    (table,) = read_moses(src, tgt, 0, "en", "ja", file_name(src, str(tmp_path)), file_name(tgt, str(tmp_path)))
    assert table.column("origin").to_pylist() == [f"{tgt}:{n}" for n in (1, 2, 3)]
    assert table.column("src").to_pylist()[0].startswith("not valid UTF-8: ")
    # Read the other way round, the bad side is the source side: its own file.
    (table,) = read_moses(tgt, src, 0, "ja", "en", file_name(tgt, str(tmp_path)), file_name(src, str(tmp_path)))
    assert table.column("origin").to_pylist() == [f"{tgt}:{n}" for n in (1, 2, 3)]
    # Both sides decode in shift_jis (ASCII English is Shift-JIS too).
    (table,) = read_moses(src, tgt, 0, "en", "ja", file_name(src, str(tmp_path)), file_name(tgt, str(tmp_path)),
                          "shift_jis")
    assert table.column("tgt").to_pylist() == ja and table.column("origin").to_pylist()[0] == f"{src}:1"


# ---- preflight and the config ---------------------------------------------------------------------

def _sources(*items: dict) -> str:
    return "data.sources=" + json.dumps(list(items))


def test_preflight_names_the_field_file_line_and_likely_encoding(tmp_path):
    en, ja = moses_pair()
    (tmp_path / "sjis.en").write_text("".join(f"{line}\n" for line in en), encoding="utf-8")
    (tmp_path / "sjis.ja").write_bytes(text(ja, "shift_jis"))
    gbk = tmp_path / "zh.tsv"
    gbk.write_bytes(text([f"{e}\t{z}" for e, z in zip(flores("eng_Latn"), flores("zho_Hans", "gbk"))], "gbk"))
    utf16 = tmp_path / "t.tsv"
    utf16.write_bytes(text([f"kor\teng\t{k}\tx" for k in KOREAN], "utf-16"))
    moses = {"path": str(tmp_path / "sjis"), "format": "moses", "src_lang": "en", "tgt_lang": "ja"}
    cfg = load_config(None, [_sources(moses, {"path": str(gbk), "format": "tsv", "src_lang": "en", "tgt_lang": "zh"},
                                      {"path": str(utf16), "format": "tatoeba"})])
    assert source_problems(cfg.data) == [
        f"data.sources[0].encoding: {tmp_path}/sjis.ja line 1 is not valid utf-8 (byte 0x81 at column 1); "
        "it reads as shift_jis: set encoding: shift_jis",
        f"data.sources[1].encoding: {gbk} line 1 is not valid utf-8 (byte 0xcb at column 90); "
        "it reads as gb18030: set encoding: gb18030",
        f"data.sources[2].encoding: {utf16} line 1 is not valid utf-8 (byte 0xff at column 1); "
        "it reads as utf-16: set encoding: utf-16",
    ]
    cfg = load_config(None, [_sources({**moses, "encoding": "shift_jis"},
                                      {"path": str(gbk), "format": "tsv", "src_lang": "en", "tgt_lang": "zh",
                                       "encoding": "gb18030"},
                                      {"path": str(utf16), "format": "tatoeba", "encoding": "utf-16"})])
    assert source_problems(cfg.data) == []


def test_an_encoding_python_does_not_know_and_one_on_parquet_are_refused(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(None, [_sources({"path": "c", "format": "moses", "src_lang": "en", "tgt_lang": "ja",
                                     "encoding": "sjis2"})])
    assert str(e.value).split("\n")[1].startswith(
        "  data.sources.0.encoding: Value error, 'sjis2' is not a text encoding Python knows (e.g. utf-8, utf-16, "
        "gb18030, shift_jis, euc-kr, big5, cp1252) (got 'sjis2', ")
    with pytest.raises(ConfigError, match=r"'base64' is not a text encoding Python knows"):
        load_config(None, [_sources({"path": "c.tsv", "format": "tsv", "encoding": "base64"})])
    with pytest.raises(ConfigError) as e:
        load_config(None, [_sources({"path": "c.parquet", "format": "parquet", "encoding": "gbk"})])
    assert str(e.value).split("\n")[1].startswith(
        "  data.sources.0: Value error, encoding 'gbk' is for text files; format 'parquet' stores its text as UTF-8, "
        "which it is read as: remove encoding (")
    assert load_config(None, [_sources({"path": "c.parquet", "format": "parquet", "encoding": "UTF8"})])


# ---- hymt translate's input -----------------------------------------------------------------------

def test_translate_input_is_read_in_its_encoding(tmp_path):
    ja = flores("jpn_Jpan", "shift_jis", 3)
    path = tmp_path / "sjis.txt"
    path.write_bytes(text(ja, "shift_jis"))
    with pytest.raises(ConfigError) as e:
        read_input([], str(path), None, src="ja")
    assert str(e.value) == (f"--input {path} line 1 is not valid utf-8 (byte 0x81 at column 1); it reads as "
                            "shift_jis: add --encoding shift_jis")
    assert read_input([], str(path), None, "shift_jis", "ja") == ja
    path.write_bytes(text(ja, "utf-16").replace(b"\n\x00", b"\r\x00\n\x00"))  # Windows line ends too
    assert read_input([], str(path), None, "utf-16", "ja") == ja
    with pytest.raises(ConfigError, match=r"^--encoding: 'sjis2' is not a text encoding Python knows"):
        read_input([], str(path), None, "sjis2", "ja")


def test_a_sources_read_tasks_decode_in_its_encoding(tmp_path):
    """The planned read tasks (run here without Ray: each is a plain function) get the source's encoding."""
    zh, en = flores("zho_Hans", "gbk", 3), flores("eng_Latn", n=3)
    tsv = tmp_path / "gbk.tsv"
    tsv.write_bytes(text([f"{e}\t{z}" for e, z in zip(en, zh)], "gbk"))
    (unit,) = plan_source(SourceConfig(path=str(tsv), format="tsv", src_lang="en", tgt_lang="zh", encoding="gbk"), 0)
    assert next(unit.read()).column("tgt").to_pylist() == zh
    tatoeba = tmp_path / "t.tsv"
    tatoeba.write_bytes(text([f"eng\tcmn\t{e}\t{z}" for e, z in zip(en, zh)], "utf-16"))
    (unit,) = plan_source(SourceConfig(path=str(tatoeba), encoding="utf-16"), 0)
    assert next(unit.read()).column("tgt").to_pylist() == zh
    csv_file = tmp_path / "c.csv"
    rows = io.StringIO()
    csv.writer(rows, lineterminator="\n").writerows(zip(en, zh))
    csv_file.write_bytes(rows.getvalue().encode("gb18030"))
    jsonl = tmp_path / "j.jsonl"
    jsonl.write_bytes(text([json.dumps({"src": e, "tgt": z}, ensure_ascii=False) for e, z in zip(en, zh)], "gb18030"))
    for fmt, path in (("csv", csv_file), ("jsonl", jsonl)):
        (unit,) = plan_source(SourceConfig(path=str(path), format=fmt, src_lang="en", tgt_lang="zh",
                                           encoding="gb18030"), 0)
        assert next(unit.read()).column("tgt").to_pylist() == zh, fmt
