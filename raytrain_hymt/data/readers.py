"""Read parallel corpora into Ray Datasets of pairs, streaming, with the origin of every row.

Every reader yields the same columns: ``src``, ``tgt``, ``src_lang``, ``tgt_lang`` (labels as found;
canonicalised by cleaning), ``origin`` (``file:line``, for error messages), ``example_id`` (a stable
64-bit id of the origin, used for exact resume and bookkeeping) and ``drop_reason`` (``malformed`` /
``invalid_utf8`` for lines that could not be parsed; counted, never silently lost).
"""

from __future__ import annotations

import gzip
import hashlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa

from raytrain_hymt.config import SourceConfig
from raytrain_hymt.sample import SAMPLE_CORPUS

LINES_PER_BLOCK = 8192
PAIR_COLUMNS = ("src", "tgt", "src_lang", "tgt_lang", "origin", "example_id", "drop_reason")


class DataSourceError(ValueError):
    """A corpus that cannot be read: missing files, mismatched Moses files, unknown columns."""


def example_id(source_index: int, origin: str) -> int:
    """Stable signed 64-bit id of a row (same bytes → same id on every machine and run)."""
    digest = hashlib.blake2b(f"{source_index}|{origin}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def expand_paths(pattern: str) -> list[str]:
    """Files matching a path, glob or URI, sorted (a fixed order keeps the data order deterministic)."""
    if pattern == "sample:":
        return [str(SAMPLE_CORPUS)]
    import pyarrow.fs as pafs

    if "://" in pattern:
        fs, base = pafs.FileSystem.from_uri(pattern.split("*")[0].rsplit("/", 1)[0] + "/")
        scheme = pattern.split("://", 1)[0]
        if any(ch in pattern for ch in "*?["):
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            import fnmatch

            pat = pattern.split("://", 1)[1]
            found = [f"{scheme}://{i.path}" for i in infos if i.is_file and fnmatch.fnmatch(i.path, pat)]
        else:
            found = [pattern] if fs.get_file_info(pattern.split("://", 1)[1]).is_file else []
    else:
        path = Path(pattern).expanduser()
        if any(ch in pattern for ch in "*?["):
            anchor = Path(path.anchor) if path.is_absolute() else Path(".")
            rel = str(path.relative_to(path.anchor)) if path.is_absolute() else str(path)
            found = [str(p.resolve()) for p in anchor.glob(rel) if p.is_file()]
        else:
            found = [str(path.resolve())] if path.is_file() else []
    if not found:
        raise DataSourceError(f"data source {pattern!r}: no such file (or the glob matched nothing)")
    return sorted(found)


def open_binary(path: str) -> io.BufferedIOBase:
    """Open a local path or pyarrow-filesystem URI for reading bytes; ``.gz`` is decompressed."""
    if "://" in path:
        import pyarrow.fs as pafs

        fs, inner = pafs.FileSystem.from_uri(path)
        raw: io.BufferedIOBase = fs.open_input_stream(inner)
    else:
        raw = open(path, "rb")
    return gzip.GzipFile(fileobj=raw) if path.endswith(".gz") else raw


LineParser = Callable[[str], tuple[str, str, str, str] | None]


def tatoeba_parser(default_src: str | None, default_tgt: str | None) -> LineParser:
    """``src_lang<TAB>tgt_lang<TAB>src<TAB>tgt`` → fields; None for a malformed line."""

    def parse(line: str):
        cols = line.split("\t")
        if len(cols) != 4:
            return None
        return cols[2], cols[3], cols[0] or default_src or "", cols[1] or default_tgt or ""

    return parse


def delimited_parser(sep: str, src_lang: str, tgt_lang: str) -> LineParser:
    """Two columns ``src<sep>tgt`` with languages from the config; None for a malformed line."""

    def parse(line: str):
        cols = line.split(sep)
        if len(cols) != 2:
            return None
        return cols[0], cols[1], src_lang, tgt_lang

    return parse


def _rows_to_table(rows: dict[str, list]) -> pa.Table:
    return pa.table(
        {
            "src": pa.array(rows["src"], pa.string()),
            "tgt": pa.array(rows["tgt"], pa.string()),
            "src_lang": pa.array(rows["src_lang"], pa.string()),
            "tgt_lang": pa.array(rows["tgt_lang"], pa.string()),
            "origin": pa.array(rows["origin"], pa.string()),
            "example_id": pa.array(rows["example_id"], pa.int64()),
            "drop_reason": pa.array(rows["drop_reason"], pa.string()),
        }
    )


def read_lines(path: str, source_index: int, parse: LineParser, display: str) -> Iterator[pa.Table]:
    """Stream one line-based file as blocks of pairs; unparseable lines become counted drop rows."""
    rows: dict[str, list] = {c: [] for c in PAIR_COLUMNS}
    with open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            origin = f"{display}:{lineno}"
            raw = raw.rstrip(b"\r\n")
            reason = ""
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line, reason = raw.decode("utf-8", errors="replace"), "invalid_utf8"
            fields = parse(line) if not reason else None
            if fields is None:
                # Keep the text (cut) so the log can show a sample of what was wrong.
                fields, reason = (line[:200], "", "", ""), reason or "malformed"
            if not raw.strip():
                continue  # blank lines (e.g. a trailing one) are not data
            src, tgt, sl, tl = fields
            for key, value in zip(PAIR_COLUMNS, (src, tgt, sl, tl, origin, example_id(source_index, origin), reason)):
                rows[key].append(value)
            if len(rows["src"]) >= LINES_PER_BLOCK:
                yield _rows_to_table(rows)
                rows = {c: [] for c in PAIR_COLUMNS}
    if rows["src"]:
        yield _rows_to_table(rows)


def _line_parser(source: SourceConfig) -> LineParser:
    if source.format == "tatoeba":
        return tatoeba_parser(source.src_lang, source.tgt_lang)
    if source.src_lang is None or source.tgt_lang is None:
        raise DataSourceError(
            f"data source {source.path!r} (format {source.format}): set src_lang and tgt_lang, "
            "the rows do not carry their languages"
        )
    return delimited_parser("\t" if source.format == "tsv" else ",", source.src_lang, source.tgt_lang)


def read_source(source: SourceConfig, source_index: int):
    """One configured source as a Ray Dataset of pairs (one read task per file, streamed in blocks)."""
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    if source.format not in ("tatoeba", "tsv", "csv"):
        raise DataSourceError(f"data source {source.path!r}: format {source.format!r} is not supported yet")
    parse = _line_parser(source)
    files = expand_paths(source.path)

    class _LineFiles(Datasource):
        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            tasks = []
            for path in files:
                display = "sample:tatoeba-eng-zho.tsv" if source.path == "sample:" else path
                meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=[path], exec_stats=None)
                tasks.append(
                    ReadTask(
                        lambda p=path, d=display: read_lines(p, source_index, parse, d),
                        meta,
                        per_task_row_limit=per_task_row_limit,
                    )
                )
            return tasks

    return ray.data.read_datasource(_LineFiles(), override_num_blocks=len(files))
