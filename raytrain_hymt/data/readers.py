"""Read parallel corpora into Ray Datasets of pairs, streaming, with the origin of every row.

Every reader yields the same columns: ``src``, ``tgt``, ``src_lang``, ``tgt_lang`` (labels as found;
canonicalised by cleaning), ``origin`` (``file:line`` for text files, ``file:row`` for Parquet/Arrow,
1-based; for error messages), ``example_id`` (a stable 64-bit id of the source index, the file's name
relative to the source's own root and the line or row: the same corpus gives the same ids wherever it
lives; used for deduplication ties, ordering and exact resume), ``source`` (index of the source in
``data.sources``) and ``drop_reason`` (``malformed`` / ``invalid_utf8`` for rows that could not be
parsed, the latter for bytes that do not decode in the source's ``encoding``; counted, never silently
lost; their ``src`` then says what was wrong and shows the raw text, for the log; a Moses row's ``origin``
names the file whose side is wrong; ``other_languages`` for a Tatoeba row outside the direction its
source's ``src_lang``/``tgt_lang`` select).

Formats (``SourceConfig.format``): ``tatoeba`` (4-column TSV), ``tsv`` / ``csv`` (2 columns; CSV through
the ``csv`` module, so quoted fields may hold commas, quotes and newlines), ``moses`` (``<prefix>.<src_lang>``
+ ``<prefix>.<tgt_lang>``, line-aligned; the prefix may be a glob), ``jsonl``, ``parquet``, ``hf_disk``
(a ``save_to_disk`` folder) and ``hf_hub`` (a ``load_dataset`` name). Text files may be gzip-compressed
(``.gz``) and are decoded in their source's ``encoding`` (UTF-8 by default). Paths may be local paths,
globs, or any pyarrow filesystem URI (``file://``, ``s3://``, ``gs://``).

Reading streams: one read task per file (per file pair for Moses), each yielding blocks of
:data:`LINES_PER_BLOCK` rows, so no process ever holds a whole corpus.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa

from raytrain_hymt.data.files import FileName, decoded_lines, invalid_text, open_random_access
from raytrain_hymt.errors import DataSourceError
from raytrain_hymt.languages import orientation

LINES_PER_BLOCK = 8192
PAIR_COLUMNS = ("src", "tgt", "src_lang", "tgt_lang", "origin", "example_id", "source", "drop_reason")
_TYPES = (pa.string(), pa.string(), pa.string(), pa.string(), pa.string(), pa.int64(), pa.int32(), pa.string())
PAIR_SCHEMA = pa.schema(list(zip(PAIR_COLUMNS, _TYPES)))
#: Characters of a bad row's raw text kept for the log.
SAMPLE_CHARS = 200


def example_id(source_index: int, where: str) -> int:
    """Stable signed 64-bit id of a row from ``<stable file name>:<line or row>`` (same bytes → same id
    on every machine and run)."""
    digest = hashlib.blake2b(f"{source_index}|{where}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


# A line parser: the pair's (src, tgt, src_lang, tgt_lang), with a drop reason as a fifth field for a row
# that parses but is not wanted, or a string saying what is wrong with it.
LineParser = Callable[[str], "tuple[str, ...] | str"]


class _Blocks:
    """Collects rows and hands out Arrow blocks of :data:`LINES_PER_BLOCK` rows."""

    def __init__(self, source_index: int, name: FileName):
        self.source_index = source_index
        self.name = name
        self.cols: dict[str, list] = {c: [] for c in PAIR_COLUMNS}

    def add(self, src: str, tgt: str, sl: str, tl: str, at: int, reason: str = "",
            shown: FileName | None = None) -> pa.Table | None:
        """A row read at line (or record) ``at`` of the file (named in ``origin`` as ``shown``, when given:
        the partner file of a Moses pair that holds the wrong side)."""
        c = self.cols
        c["src"].append(src)
        c["tgt"].append(tgt)
        c["src_lang"].append(sl)
        c["tgt_lang"].append(tl)
        c["origin"].append(f"{(shown or self.name).display}:{at}")
        c["example_id"].append(example_id(self.source_index, f"{self.name.stable}:{at}"))
        c["source"].append(self.source_index)
        c["drop_reason"].append(reason)
        return self.flush() if len(c["src"]) >= LINES_PER_BLOCK else None

    def bad(self, at: int, reason: str, problem: str, raw: str, shown: FileName | None = None) -> pa.Table | None:
        """A row that could not be parsed: kept (to be counted) with what was wrong and the raw text."""
        return self.add(f"{problem}: {raw[:SAMPLE_CHARS]}", "", "", "", at, reason, shown)

    def flush(self) -> pa.Table | None:
        if not self.cols["src"]:
            return None
        table = pa.table(self.cols, schema=PAIR_SCHEMA)
        self.cols = {c: [] for c in PAIR_COLUMNS}
        return table


def tatoeba_parser(src_lang: str | None, tgt_lang: str | None) -> LineParser:
    """``src_lang<TAB>tgt_lang<TAB>src<TAB>tgt`` → fields; a problem string for a malformed line.

    ``src_lang``/``tgt_lang`` (the source's settings; either may be None) fill an empty label column and
    select the direction: a row labelled the other way round is swapped, one that carries neither
    language pair gets the drop reason ``other_languages`` (a fifth field)."""
    select = bool(src_lang or tgt_lang)

    def parse(line: str):
        cols = line.split("\t")
        if len(cols) != 4:
            return f"expected 4 tab-separated columns, got {len(cols)}"
        src, tgt, sl, tl = cols[2], cols[3], cols[0] or src_lang or "", cols[1] or tgt_lang or ""
        if not select:
            return src, tgt, sl, tl
        how = orientation(sl, tl, src_lang, tgt_lang)
        if how == "swap":
            return tgt, src, tl, sl
        return (src, tgt, sl, tl) if how == "keep" else (src, tgt, sl, tl, "other_languages")

    return parse


def delimited_parser(sep: str, src_lang: str, tgt_lang: str) -> LineParser:
    """Two columns ``src<sep>tgt`` (no quoting) with languages from the config."""

    def parse(line: str):
        cols = line.split(sep)
        if len(cols) != 2:
            return f"expected 2 {sep!r}-separated columns, got {len(cols)}"
        return cols[0], cols[1], src_lang, tgt_lang

    return parse


def read_line_tables(path: str, source_index: int, parse: LineParser, name: FileName,
                     encoding: str = "utf-8") -> Iterator[pa.Table]:
    """Stream one line-based file as blocks of pairs; unparseable lines become counted drop rows.
    Blank lines (e.g. a trailing one) are not data and are skipped."""
    blocks = _Blocks(source_index, name)
    for lineno, line, ok in decoded_lines(path, encoding):
        if not line.strip():
            continue
        fields = parse(line) if ok else invalid_text(encoding)
        if isinstance(fields, str):
            out = blocks.bad(lineno, "malformed" if ok else "invalid_utf8", fields, line)
        else:
            out = blocks.add(*fields[:4], lineno, *fields[4:])
        if out is not None:
            yield out
    if (last := blocks.flush()) is not None:
        yield last


def read_csv(path: str, source_index: int, src_lang: str, tgt_lang: str, name: FileName,
             encoding: str = "utf-8") -> Iterator[pa.Table]:
    """Stream a 2-column CSV (RFC 4180 quoting through the ``csv`` module; a record may span lines).

    ``origin`` is the record's first line. A record with another number of fields, or one the ``csv``
    module rejects (e.g. a stray quote), is ``malformed``; one touching a line that does not decode in
    ``encoding`` is ``invalid_utf8``.
    """
    blocks = _Blocks(source_index, name)
    state = {"first": 0, "last": 0, "bad_utf8": False, "text": []}

    def lines() -> Iterator[str]:
        for lineno, line, ok in decoded_lines(path, encoding):
            if not state["first"]:
                state["first"] = lineno
            state["last"] = lineno
            state["bad_utf8"] |= not ok
            state["text"].append(line)
            yield line + "\n"

    reader = csv.reader(lines(), strict=True)
    while True:
        try:
            record = next(reader)
            problem = "" if len(record) == 2 else f"expected 2 comma-separated fields, got {len(record)}"
        except StopIteration:
            break
        except csv.Error as e:
            record, problem = [], f"CSV error: {e}"
        at, raw = state["first"], "\n".join(state["text"])
        if state["bad_utf8"]:
            out = blocks.bad(at, "invalid_utf8", invalid_text(encoding), raw)
        elif problem:
            out = blocks.bad(at, "malformed", problem, raw)
        elif not record or not "".join(record).strip():
            out = None  # a blank line
        else:
            out = blocks.add(record[0], record[1], src_lang, tgt_lang, at)
        state.update(first=0, bad_utf8=False, text=[])
        if out is not None:
            yield out
    if (last := blocks.flush()) is not None:
        yield last


def read_moses(src_path: str, tgt_path: str, source_index: int, src_lang: str, tgt_lang: str,
               name: FileName, tgt_name: FileName, encoding: str = "utf-8") -> Iterator[pa.Table]:
    """Stream a Moses file pair line by line. Every line is a row (an empty side is dropped later as
    ``empty``, so the alignment is never shifted); ``origin`` names the source-side file (``name``, also
    the rows' ids), except for a row whose target side does not decode: that names ``tgt_name``."""
    blocks = _Blocks(source_index, name)
    src_lines, tgt_lines = decoded_lines(src_path, encoding), decoded_lines(tgt_path, encoding)
    for (lineno, src, ok_src), (_, tgt, ok_tgt) in zip(src_lines, tgt_lines, strict=True):
        if ok_src and ok_tgt:
            out = blocks.add(src, tgt, src_lang, tgt_lang, lineno)
        elif not ok_src:
            out = blocks.bad(lineno, "invalid_utf8", invalid_text(encoding), src)
        else:
            out = blocks.bad(lineno, "invalid_utf8", invalid_text(encoding), tgt, shown=tgt_name)
        if out is not None:
            yield out
    if (last := blocks.flush()) is not None:
        yield last


# ---------------------------------------------------------------------------------------------------
# Columnar sources: JSONL objects, Parquet, Arrow (Hugging Face datasets)


@dataclass(frozen=True)
class Columns:
    """Where the texts are: ``src_column``/``tgt_column`` hold strings, or (Hugging Face's shape) a dict
    or struct keyed by language, e.g. ``translation: {"en": ..., "zh": ...}``, read at ``src_lang`` /
    ``tgt_lang``."""

    src_column: str
    tgt_column: str
    src_lang: str
    tgt_lang: str

    def text(self, row: dict, column: str, lang: str) -> str:
        """One side of a JSON object row; ``ValueError`` says what is missing or wrong."""
        if column not in row:
            raise ValueError(f"no field {column!r} (fields: {', '.join(map(str, row)) or 'none'})")
        value = row[column]
        if isinstance(value, dict):
            if lang not in value:
                raise ValueError(f"field {column!r} has no key {lang!r} (keys: {', '.join(map(str, value))})")
            value = value[lang]
        if value is None:
            return ""
        if not isinstance(value, str):
            raise ValueError(f"field {column!r} is {type(value).__name__}, not text")
        return value


def read_jsonl(path: str, source_index: int, columns: Columns, name: FileName,
               encoding: str = "utf-8") -> Iterator[pa.Table]:
    """Stream a JSON-lines file: one object per line; a line that is not an object with both texts is
    ``malformed`` (its ``src`` says why)."""
    blocks = _Blocks(source_index, name)
    for lineno, line, ok in decoded_lines(path, encoding):
        if not line.strip():
            continue
        if not ok:
            out = blocks.bad(lineno, "invalid_utf8", invalid_text(encoding), line)
        else:
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                src = columns.text(row, columns.src_column, columns.src_lang)
                tgt = columns.text(row, columns.tgt_column, columns.tgt_lang)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                out = blocks.bad(lineno, "malformed", str(e), line)
            else:
                out = blocks.add(src, tgt, columns.src_lang, columns.tgt_lang, lineno)
        if out is not None:
            yield out
    if (last := blocks.flush()) is not None:
        yield last


def _text_column(batch: pa.RecordBatch, column: str, lang: str, display: str) -> list:
    """One side of an Arrow batch as Python strings (None for nulls); a missing or non-text column is a
    :class:`DataSourceError` (the whole file is wrong, not one row)."""
    names = batch.schema.names
    if column not in names:
        raise DataSourceError(
            f"{display}: no column {column!r} (columns: {', '.join(names)}); set src_column/tgt_column "
            "(for Hugging Face's translation dicts: src_column and tgt_column 'translation')"
        )
    array = batch.column(column)
    if pa.types.is_struct(array.type):
        fields = [array.type.field(i).name for i in range(array.type.num_fields)]
        if lang not in fields:
            raise DataSourceError(f"{display}: column {column!r} has no field {lang!r} (fields: {', '.join(fields)})")
        array = array.field(lang)
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        raise DataSourceError(f"{display}: column {column!r} holds {array.type}, not text")
    return array.to_pylist()


def read_batches(batches: Iterable[pa.RecordBatch], source_index: int, columns: Columns, name: FileName) -> Iterator[pa.Table]:
    """Arrow record batches (Parquet, Arrow IPC) → blocks of pairs; ``origin`` is ``file:row``."""
    blocks = _Blocks(source_index, name)
    row = 0
    for batch in batches:
        srcs = _text_column(batch, columns.src_column, columns.src_lang, name.display)
        tgts = _text_column(batch, columns.tgt_column, columns.tgt_lang, name.display)
        for src, tgt in zip(srcs, tgts):
            row += 1
            out = blocks.add(src or "", tgt or "", columns.src_lang, columns.tgt_lang, row)
            if out is not None:
                yield out
    if (last := blocks.flush()) is not None:
        yield last


def parquet_batches(path: str, columns: Columns) -> Iterator[pa.RecordBatch]:
    """Record batches of a Parquet file, only the text columns, streamed."""
    import pyarrow.parquet as pq

    with open_random_access(path) as f:
        pf = pq.ParquetFile(f)
        wanted = {columns.src_column, columns.tgt_column}
        # A missing column: read them all, so the error (in read_batches) lists what the file has.
        subset = sorted(wanted) if wanted <= set(pf.schema_arrow.names) else None
        yield from pf.iter_batches(batch_size=LINES_PER_BLOCK, columns=subset)


def arrow_stream_batches(path: str) -> Iterator[pa.RecordBatch]:
    """Record batches of an Arrow IPC stream file (the cache/``save_to_disk`` files of HF datasets), memory-mapped."""
    with pa.memory_map(path) as source:
        yield from pa.ipc.open_stream(source)


# ---------------------------------------------------------------------------------------------------
# Planning: source config → read units (one per file or file pair)
