"""Read parallel corpora into Ray Datasets of pairs, streaming, with the origin of every row.

Every reader yields the same columns: ``src``, ``tgt``, ``src_lang``, ``tgt_lang`` (labels as found;
canonicalised by cleaning), ``origin`` (``file:line`` for text files, ``file:row`` for Parquet/Arrow,
1-based; for error messages), ``example_id`` (a stable 64-bit id of the source index, the file's name
relative to the source's own root and the line or row: the same corpus gives the same ids wherever it
lives; used for deduplication ties, ordering and exact resume), ``source`` (index of the source in
``data.sources``) and ``drop_reason`` (``malformed`` / ``invalid_utf8`` for rows that could not be
parsed; counted, never silently lost; their ``src`` then says what was wrong and shows the raw text, for
the log).

Formats (``SourceConfig.format``): ``tatoeba`` (4-column TSV), ``tsv`` / ``csv`` (2 columns; CSV through
the ``csv`` module, so quoted fields may hold commas, quotes and newlines), ``moses`` (``<prefix>.<src_lang>``
+ ``<prefix>.<tgt_lang>``, line-aligned; the prefix may be a glob), ``jsonl``, ``parquet``, ``hf_disk``
(a ``save_to_disk`` folder) and ``hf_hub`` (a ``load_dataset`` name). Text files may be gzip-compressed
(``.gz``). Paths may be local paths, globs, or any pyarrow filesystem URI (``file://``, ``s3://``, ``gs://``).

Reading streams: one read task per file (per file pair for Moses), each yielding blocks of
:data:`LINES_PER_BLOCK` rows, so no process ever holds a whole corpus.
"""

from __future__ import annotations

import csv
import fnmatch
import gzip
import hashlib
import io
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from raytrain_hymt.config import SourceConfig
from raytrain_hymt.sample import SAMPLE_CORPUS

LINES_PER_BLOCK = 8192
PAIR_COLUMNS = ("src", "tgt", "src_lang", "tgt_lang", "origin", "example_id", "source", "drop_reason")
_TYPES = (pa.string(), pa.string(), pa.string(), pa.string(), pa.string(), pa.int64(), pa.int32(), pa.string())
PAIR_SCHEMA = pa.schema(list(zip(PAIR_COLUMNS, _TYPES)))
#: Characters of a bad row's raw text kept for the log.
SAMPLE_CHARS = 200


class DataSourceError(ValueError):
    """A corpus that cannot be read: missing files, mismatched Moses files, unknown columns."""


def example_id(source_index: int, where: str) -> int:
    """Stable signed 64-bit id of a row from ``<stable file name>:<line or row>`` (same bytes → same id
    on every machine and run)."""
    digest = hashlib.blake2b(f"{source_index}|{where}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass(frozen=True)
class FileName:
    """How a file is named in its rows: ``display`` in messages (``origin``: the path the user gave,
    resolved), ``stable`` in ``example_id`` (relative to the source's own root, never an absolute or
    cache path, so a corpus copied or mounted elsewhere keeps its ids and its order)."""

    display: str
    stable: str


def source_root(pattern: str) -> str:
    """The folder a source's files are named relative to: its path or URI up to the last ``/`` before
    the first glob character (``/data/wmt/*.tsv`` → ``/data/wmt``; a single file or Moses prefix → its
    folder); local paths resolved, as :func:`expand_paths` resolves the files."""
    cut = min((pattern.index(ch) for ch in "*?[" if ch in pattern), default=len(pattern))
    root = pattern[:cut].rsplit("/", 1)[0] if "/" in pattern[:cut] else ""
    if "://" in pattern:
        return root
    return str(Path(root or ".").expanduser().resolve())


def file_name(path: str, root: str) -> FileName:
    """``path`` named for messages (as is) and for ids (relative to ``root``; its base name when outside)."""
    prefix = root.rstrip("/") + "/"
    return FileName(path, path[len(prefix):] if path.startswith(prefix) else path.rsplit("/", 1)[-1])


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def expand_paths(pattern: str, *, required: bool = True) -> list[str]:
    """Files matching a path, glob or URI, sorted (a fixed order keeps the data order deterministic).

    ``required``: raise :class:`DataSourceError` when nothing matches (else return ``[]``).
    """
    if pattern == "sample:":
        return [str(SAMPLE_CORPUS)]
    if "://" in pattern:
        import pyarrow.fs as pafs

        scheme, rest = pattern.split("://", 1)
        try:
            fs, _ = pafs.FileSystem.from_uri(pattern.split("*")[0].rsplit("/", 1)[0] + "/")
        except (pa.ArrowInvalid, OSError) as e:
            raise DataSourceError(f"data source {pattern!r}: cannot open its filesystem: {e}") from None
        # from_uri keeps the host part of a local URI out of the path; object stores keep the bucket in it.
        inner = rest if scheme != "file" else "/" + rest.lstrip("/")
        if _is_glob(pattern):
            base = inner.split("*")[0].rsplit("/", 1)[0]
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
            found = [f"{scheme}://{i.path}" for i in infos if i.is_file and fnmatch.fnmatch(i.path, inner)]
        else:
            found = [pattern] if fs.get_file_info(inner).is_file else []
    else:
        path = Path(pattern).expanduser()
        if _is_glob(pattern):
            anchor = Path(path.anchor) if path.is_absolute() else Path(".")
            rel = str(path.relative_to(path.anchor)) if path.is_absolute() else str(path)
            found = [str(p.resolve()) for p in anchor.glob(rel) if p.is_file()]
        else:
            found = [str(path.resolve())] if path.is_file() else []
    if not found and required:
        raise DataSourceError(f"data source {pattern!r}: no such file (or the glob matched nothing)")
    return sorted(found)


def _filesystem(path: str):
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(path)


def open_binary(path: str) -> io.BufferedIOBase:
    """Open a local path or pyarrow-filesystem URI for reading bytes; ``.gz`` is decompressed."""
    if "://" in path:
        fs, inner = _filesystem(path)
        # pyarrow streams read bytes but cannot iterate lines; a BufferedReader can.
        raw: io.BufferedIOBase = io.BufferedReader(fs.open_input_stream(inner))
    else:
        raw = open(path, "rb")
    return _ClosingGzip(raw) if path.endswith(".gz") else raw


class _ClosingGzip(gzip.GzipFile):
    """A GzipFile that also closes the stream it reads (``GzipFile(fileobj=...)`` leaves it open)."""

    def __init__(self, raw):
        super().__init__(fileobj=raw)
        self._raw = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw.close()


def open_random_access(path: str):
    """A seekable file (Parquet needs one) for a local path or a pyarrow-filesystem URI."""
    if "://" in path:
        fs, inner = _filesystem(path)
        return fs.open_input_file(inner)
    return pa.OSFile(path, "rb")


def count_lines(path: str) -> int:
    """Lines in a (possibly gzipped) text file, as Python's line iteration counts them."""
    n, last = 0, b"\n"
    with open_binary(path) as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


# ---------------------------------------------------------------------------------------------------
# Rows → blocks


class _Blocks:
    """Collects rows and hands out Arrow blocks of :data:`LINES_PER_BLOCK` rows."""

    def __init__(self, source_index: int, name: FileName):
        self.source_index = source_index
        self.name = name
        self.cols: dict[str, list] = {c: [] for c in PAIR_COLUMNS}

    def add(self, src: str, tgt: str, sl: str, tl: str, at: int, reason: str = "") -> pa.Table | None:
        """A row read at line (or record) ``at`` of the file."""
        c = self.cols
        c["src"].append(src)
        c["tgt"].append(tgt)
        c["src_lang"].append(sl)
        c["tgt_lang"].append(tl)
        c["origin"].append(f"{self.name.display}:{at}")
        c["example_id"].append(example_id(self.source_index, f"{self.name.stable}:{at}"))
        c["source"].append(self.source_index)
        c["drop_reason"].append(reason)
        return self.flush() if len(c["src"]) >= LINES_PER_BLOCK else None

    def bad(self, at: int, reason: str, problem: str, raw: str) -> pa.Table | None:
        """A row that could not be parsed: kept (to be counted) with what was wrong and the raw text."""
        return self.add(f"{problem}: {raw[:SAMPLE_CHARS]}", "", "", "", at, reason)

    def flush(self) -> pa.Table | None:
        if not self.cols["src"]:
            return None
        table = pa.table(self.cols, schema=PAIR_SCHEMA)
        self.cols = {c: [] for c in PAIR_COLUMNS}
        return table


def _decoded_lines(path: str) -> Iterator[tuple[int, str, bool]]:
    """``(line number, text without the line end, decoded cleanly)`` of a text file; a UTF-8 byte order
    mark (Windows editors write one) is not part of the first line's text."""
    with open_binary(path) as f:
        for lineno, raw in enumerate(f, start=1):
            raw = raw.rstrip(b"\r\n")
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                yield lineno, raw.decode("utf-8"), True
            except UnicodeDecodeError:
                yield lineno, raw.decode("utf-8", errors="replace"), False


# A line parser: the pair's (src, tgt, src_lang, tgt_lang), or a string saying what is wrong with it.
LineParser = Callable[[str], "tuple[str, str, str, str] | str"]


def tatoeba_parser(default_src: str | None, default_tgt: str | None) -> LineParser:
    """``src_lang<TAB>tgt_lang<TAB>src<TAB>tgt`` → fields; a problem string for a malformed line."""

    def parse(line: str):
        cols = line.split("\t")
        if len(cols) != 4:
            return f"expected 4 tab-separated columns, got {len(cols)}"
        return cols[2], cols[3], cols[0] or default_src or "", cols[1] or default_tgt or ""

    return parse


def delimited_parser(sep: str, src_lang: str, tgt_lang: str) -> LineParser:
    """Two columns ``src<sep>tgt`` (no quoting) with languages from the config."""

    def parse(line: str):
        cols = line.split(sep)
        if len(cols) != 2:
            return f"expected 2 {sep!r}-separated columns, got {len(cols)}"
        return cols[0], cols[1], src_lang, tgt_lang

    return parse


def read_lines(path: str, source_index: int, parse: LineParser, name: FileName) -> Iterator[pa.Table]:
    """Stream one line-based file as blocks of pairs; unparseable lines become counted drop rows.
    Blank lines (e.g. a trailing one) are not data and are skipped."""
    blocks = _Blocks(source_index, name)
    for lineno, line, ok in _decoded_lines(path):
        if not line.strip():
            continue
        fields = parse(line) if ok else "not valid UTF-8"
        if isinstance(fields, str):
            out = blocks.bad(lineno, "malformed" if ok else "invalid_utf8", fields, line)
        else:
            out = blocks.add(*fields, lineno)
        if out is not None:
            yield out
    if (last := blocks.flush()) is not None:
        yield last


def read_csv(path: str, source_index: int, src_lang: str, tgt_lang: str, name: FileName) -> Iterator[pa.Table]:
    """Stream a 2-column CSV (RFC 4180 quoting through the ``csv`` module; a record may span lines).

    ``origin`` is the record's first line. A record with another number of fields, or one the ``csv``
    module rejects (e.g. a stray quote), is ``malformed``; one touching a line that is not valid UTF-8 is
    ``invalid_utf8``.
    """
    blocks = _Blocks(source_index, name)
    state = {"first": 0, "last": 0, "bad_utf8": False, "text": []}

    def lines() -> Iterator[str]:
        for lineno, line, ok in _decoded_lines(path):
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
            out = blocks.bad(at, "invalid_utf8", "not valid UTF-8", raw)
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
               name: FileName) -> Iterator[pa.Table]:
    """Stream a Moses file pair line by line. Every line is a row (an empty side is dropped later as
    ``empty``, so the alignment is never shifted); ``origin`` (``name``) names the source-side file."""
    blocks = _Blocks(source_index, name)
    src_lines, tgt_lines = _decoded_lines(src_path), _decoded_lines(tgt_path)
    for (lineno, src, ok_src), (_, tgt, ok_tgt) in zip(src_lines, tgt_lines, strict=True):
        if ok_src and ok_tgt:
            out = blocks.add(src, tgt, src_lang, tgt_lang, lineno)
        else:
            bad = src_path if not ok_src else tgt_path
            out = blocks.bad(lineno, "invalid_utf8", f"not valid UTF-8 in {bad}", src if not ok_src else tgt)
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


def read_jsonl(path: str, source_index: int, columns: Columns, name: FileName) -> Iterator[pa.Table]:
    """Stream a JSON-lines file: one object per line; a line that is not an object with both texts is
    ``malformed`` (its ``src`` says why)."""
    blocks = _Blocks(source_index, name)
    for lineno, line, ok in _decoded_lines(path):
        if not line.strip():
            continue
        if not ok:
            out = blocks.bad(lineno, "invalid_utf8", "not valid UTF-8", line)
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


@dataclass(frozen=True)
class ReadUnit:
    """One read task: a function producing blocks, and the files it reads (for Ray's metadata)."""

    read: Callable[[], Iterator[pa.Table]]
    files: tuple[str, ...]


def _languages(source: SourceConfig) -> tuple[str, str]:
    if source.src_lang is None or source.tgt_lang is None:
        raise DataSourceError(
            f"data source {source.path!r} (format {source.format}): set src_lang and tgt_lang, "
            "the rows do not carry their languages"
        )
    return source.src_lang, source.tgt_lang


def moses_pairs(source: SourceConfig) -> list[tuple[str, str]]:
    """``(<prefix>.<src_lang>, <prefix>.<tgt_lang>)`` file pairs of a Moses source (``.gz`` allowed); a
    missing partner is a :class:`DataSourceError`."""
    src_lang, tgt_lang = _languages(source)
    pairs = []
    for gz in ("", ".gz"):
        for src_file in expand_paths(f"{source.path}.{src_lang}{gz}", required=False):
            tgt_file = src_file[: len(src_file) - len(f".{src_lang}{gz}")] + f".{tgt_lang}{gz}"
            if not expand_paths(tgt_file, required=False):
                raise DataSourceError(f"Moses source {source.path!r}: {src_file} has no partner {tgt_file}")
            pairs.append((src_file, tgt_file))
    if not pairs:
        raise DataSourceError(
            f"Moses source {source.path!r}: no files {source.path}.{src_lang} (or .{src_lang}.gz) found"
        )
    return sorted(pairs)


def check_moses_line_counts(pairs: list[tuple[str, str]]) -> None:
    """Count the lines of every Moses file pair in parallel Ray tasks (a fast pre-pass when the dataset
    is planned, before any training) and raise :class:`DataSourceError` naming both files and both
    counts when a pair differs."""
    import ray

    counter = ray.remote(num_cpus=0.5)(count_lines)
    files = [f for pair in pairs for f in pair]
    counts = dict(zip(files, ray.get([counter.remote(f) for f in files])))
    bad = [f"{s} has {counts[s]} lines but {t} has {counts[t]}" for s, t in pairs if counts[s] != counts[t]]
    if bad:
        raise DataSourceError("Moses files are not line-aligned: " + "; ".join(bad))


def hf_arrow_files(source: SourceConfig) -> list[str]:
    """The Arrow files behind a Hugging Face dataset: a ``save_to_disk`` folder (``hf_disk``) or a
    ``load_dataset`` name resolved through the local cache or the hub (``hf_hub``)."""
    import datasets

    try:
        if source.format == "hf_disk":
            ds = datasets.load_from_disk(source.path)
        else:
            ds = datasets.load_dataset(source.path, split=source.split)
    except FileNotFoundError as e:
        raise DataSourceError(f"data source {source.path!r} ({source.format}): not found: {e}") from None
    except Exception as e:  # noqa: BLE001 - hub errors come in many types (offline, 404, auth): say which
        raise DataSourceError(
            f"data source {source.path!r} (hf_hub): load_dataset failed: {type(e).__name__}: {e}. "
            "Offline, a hub dataset must already be in the Hugging Face cache (HF_DATASETS_CACHE); "
            "or save it with save_to_disk and use format hf_disk."
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise DataSourceError(f"data source {source.path!r}: no split {source.split!r} (splits: {', '.join(ds)})")
        ds = ds[source.split]
    files = [f["filename"] for f in ds.cache_files]
    if not files:
        raise DataSourceError(f"data source {source.path!r}: the dataset is held in memory only, no Arrow files to stream")
    return files


def namer(source: SourceConfig) -> Callable[[str], FileName]:
    """How the files of ``source`` are named in rows (:class:`FileName`): the bundled sample by its own
    name, a Hugging Face hub dataset's cache files by their base names (the cache folder is no part of
    the data), every other file relative to the source's root (its folder, for ``hf_disk``)."""
    if source.path == "sample:":
        return lambda path: FileName("sample:tatoeba-eng-zho.tsv", "sample:tatoeba-eng-zho.tsv")
    if source.format == "hf_hub":
        return lambda path: FileName(path, path.rsplit("/", 1)[-1])
    root = str(Path(source.path).expanduser().resolve()) if source.format == "hf_disk" else source_root(source.path)
    return lambda path: file_name(str(Path(path).resolve()) if source.format == "hf_disk" else path, root)


def plan_source(source: SourceConfig, source_index: int) -> list[ReadUnit]:
    """The read tasks of one configured source. Checks what can be checked before reading (files exist,
    Moses line counts, languages given); row-level problems are found while reading."""
    fmt = source.format
    name = namer(source)
    if fmt == "moses":
        src_lang, tgt_lang = _languages(source)
        pairs = moses_pairs(source)
        check_moses_line_counts(pairs)
        return [ReadUnit(lambda s=s, t=t: read_moses(s, t, source_index, src_lang, tgt_lang, name(s)), (s, t))
                for s, t in pairs]
    if fmt in ("hf_disk", "hf_hub"):
        files = hf_arrow_files(source)
    else:
        files = expand_paths(source.path)

    if fmt == "tatoeba":
        parse = tatoeba_parser(source.src_lang, source.tgt_lang)
        return [ReadUnit(lambda p=p: read_lines(p, source_index, parse, name(p)), (p,)) for p in files]
    src_lang, tgt_lang = _languages(source)
    if fmt == "tsv":
        parse = delimited_parser("\t", src_lang, tgt_lang)
        return [ReadUnit(lambda p=p: read_lines(p, source_index, parse, name(p)), (p,)) for p in files]
    if fmt == "csv":
        return [ReadUnit(lambda p=p: read_csv(p, source_index, src_lang, tgt_lang, name(p)), (p,)) for p in files]
    columns = Columns(source.src_column, source.tgt_column, src_lang, tgt_lang)
    if fmt == "jsonl":
        return [ReadUnit(lambda p=p: read_jsonl(p, source_index, columns, name(p)), (p,)) for p in files]
    if fmt == "parquet":
        return [ReadUnit(lambda p=p: read_batches(parquet_batches(p, columns), source_index, columns, name(p)), (p,))
                for p in files]
    return [ReadUnit(lambda p=p: read_batches(arrow_stream_batches(p), source_index, columns, name(p)), (p,)) for p in files]


def _planned_datasource(units: list[ReadUnit]):
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class PlannedFiles(Datasource):
        """One Ray read task per :class:`ReadUnit`, in plan order."""

        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            tasks = []
            for unit in units:
                meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=list(unit.files), exec_stats=None)
                tasks.append(ReadTask(unit.read, meta, schema=PAIR_SCHEMA, per_task_row_limit=per_task_row_limit))
            return tasks

    return PlannedFiles()


def read_units(units: list[ReadUnit]):
    """Planned read tasks as a Ray Dataset of pairs (one read task per unit, streamed in blocks)."""
    import ray.data

    return ray.data.read_datasource(_planned_datasource(units), override_num_blocks=len(units))


def read_source(source: SourceConfig, source_index: int):
    """One configured source as a Ray Dataset of pairs (one read task per file, streamed in blocks)."""
    return read_units(plan_source(source, source_index))


def file_size(path: str) -> int:
    """Bytes of a local file or pyarrow-filesystem URI."""
    if "://" in path:
        fs, inner = _filesystem(path)
        return fs.get_file_info(inner).size
    return Path(path).stat().st_size
