"""Files of a corpus wherever they live: globs and URIs expanded, opened (gzip too) through pyarrow's
filesystems, counted and named relative to their source's root, and their text decoded line by line
with the line number and whether it was valid UTF-8. ``sample:`` names the bundled sample corpus (real
Tatoeba eng-zho pairs; license in ``data/sample_data/NOTICE.md``).
"""

from __future__ import annotations

import fnmatch
import gzip
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from raytrain_hymt.errors import DataSourceError
from raytrain_hymt.storage import is_uri


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
    if is_uri(pattern):
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
    if is_uri(pattern):
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
    if is_uri(path):
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
    if is_uri(path):
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


def decoded_lines(path: str) -> Iterator[tuple[int, str, bool]]:
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


def file_size(path: str) -> int:
    """Bytes of a local file or pyarrow-filesystem URI."""
    if is_uri(path):
        fs, inner = _filesystem(path)
        return fs.get_file_info(inner).size
    return Path(path).stat().st_size


SAMPLE_CORPUS = Path(__file__).parent / "sample_data" / "tatoeba-eng-zho.tsv"
