"""Files of a corpus wherever they live: globs and URIs expanded, opened (gzip too) through pyarrow's
filesystems, counted and named relative to their source's root, and their text decoded line by line in
the source's encoding with the line number and whether it decoded cleanly; for a file that does not
decode, the encoding it most likely is in. ``sample:`` names the bundled sample corpus (real Tatoeba
eng-zho pairs; license in ``data/sample_data/NOTICE.md``).
"""

from __future__ import annotations

import codecs
import fnmatch
import gzip
import io
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from raytrain_hymt.errors import DataSourceError
from raytrain_hymt.languages import LANGUAGES, is_supported, resolve
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


def count_lines(path: str, encoding: str = "utf-8") -> int:
    """Lines in a (possibly gzipped) text file in ``encoding``, as Python's line iteration counts them."""
    if not _lines_end_in_newline_bytes(encoding):
        with _text_stream(path, encoding, "replace") as text:
            return sum(1 for _ in text)
    n, last = 0, b"\n"
    with open_binary(path) as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


# ---------------------------------------------------------------------------------------------------
# Rows → blocks


def reading_codec(encoding: str) -> str:
    """The codec that reads text in ``encoding``: UTF-8 as ``utf-8-sig``, so the byte order mark Windows
    editors write is not part of the first line's text."""
    return "utf-8-sig" if codecs.lookup(encoding).name == "utf-8" else encoding


def _lines_end_in_newline_bytes(encoding: str) -> bool:
    # In UTF-8, the legacy CJK encodings and single-byte code pages byte 0x0A is a line end and never part
    # of another character, so lines are cut on bytes and decoded one by one; UTF-16/32 (and EBCDIC) are not.
    return "\n".encode(encoding) == b"\n"


def _text_stream(path: str, encoding: str, errors: str) -> io.TextIOWrapper:
    """``path`` decoded as a stream; lines end at ``\n`` only, kept as they are."""
    return io.TextIOWrapper(open_binary(path), encoding=reading_codec(encoding), errors=errors, newline="\n")


def invalid_text(encoding: str) -> str:
    """What a row that does not decode is called: ``not valid UTF-8``, ``not valid shift_jis``."""
    return "not valid UTF-8" if codecs.lookup(encoding).name in ("utf-8", "utf-8-sig") else f"not valid {encoding}"


# Marks where bytes did not decode in a stream decoded as a whole: a lone surrogate, which no decoder
# produces from valid input; shown as U+FFFD, like the "replace" handler (one per undecodable stretch).
_UNDECODED = "\udcff"
codecs.register_error("hymt-mark-undecoded", lambda e: (_UNDECODED, e.end))


def decoded_lines(path: str, encoding: str = "utf-8") -> Iterator[tuple[int, str, bool]]:
    """``(line number, text without the line end, decoded cleanly)`` of a text file in ``encoding``; a
    byte order mark (UTF-8's, which Windows editors write, or UTF-16's) is not part of the first line's
    text. A line that does not decode is given with U+FFFD for the bytes that did not."""
    if _lines_end_in_newline_bytes(encoding):
        utf8 = codecs.lookup(encoding).name in ("utf-8", "utf-8-sig")
        with open_binary(path) as f:
            for lineno, raw in enumerate(f, start=1):
                raw = raw.rstrip(b"\r\n")
                if lineno == 1 and utf8:
                    raw = raw.removeprefix(b"\xef\xbb\xbf")
                try:
                    yield lineno, raw.decode(encoding), True
                except UnicodeDecodeError:
                    yield lineno, raw.decode(encoding, errors="replace"), False
        return
    with _text_stream(path, encoding, "hymt-mark-undecoded") as text:
        for lineno, line in enumerate(text, start=1):
            line = line.rstrip("\r\n")
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            yield lineno, line.replace(_UNDECODED, "\ufffd"), _UNDECODED not in line


def file_size(path: str) -> int:
    """Bytes of a local file or pyarrow-filesystem URI."""
    if is_uri(path):
        fs, inner = _filesystem(path)
        return fs.get_file_info(inner).size
    return Path(path).stat().st_size


SAMPLE_CORPUS = Path(__file__).parent / "sample_data" / "tatoeba-eng-zho.tsv"


# ---------------------------------------------------------------------------------------------------
# Which encoding a file that does not decode is in

#: Bytes at the start of a file read to check its encoding.
HEAD_BYTES = 8192
#: Share of a decoded text's letters (beyond ASCII) that must be in its language's script for a guess.
MOSTLY = 0.6
# Scripts (the first word of a character's Unicode name) of languages not written in Latin letters.
_SCRIPTS: dict[str, frozenset[str]] = {
    **dict.fromkeys(("zh", "zh-Hant", "yue"), frozenset({"CJK"})),
    "ja": frozenset({"CJK", "HIRAGANA", "KATAKANA"}), "ko": frozenset({"HANGUL"}),
    **dict.fromkeys(("ru", "uk", "kk"), frozenset({"CYRILLIC"})), "mn": frozenset({"CYRILLIC", "MONGOLIAN"}),
    **dict.fromkeys(("ar", "fa", "ur", "ug"), frozenset({"ARABIC"})), "he": frozenset({"HEBREW"}),
    "th": frozenset({"THAI"}), **dict.fromkeys(("hi", "mr"), frozenset({"DEVANAGARI"})), "bn": frozenset({"BENGALI"}),
    "ta": frozenset({"TAMIL"}), "te": frozenset({"TELUGU"}), "gu": frozenset({"GUJARATI"}), "km": frozenset({"KHMER"}),
    "my": frozenset({"MYANMAR"}), "bo": frozenset({"TIBETAN"}),
}
# A language's own legacy encodings, tried before the others (in this order: the commoner first; cp932,
# cp949 and cp950 are Windows' supersets of shift_jis, euc-kr and big5).
_NATIVE: dict[str, tuple[str, ...]] = {
    "ja": ("shift_jis", "cp932", "euc_jp"), "zh": ("gb18030",), "zh-Hant": ("big5", "cp950"), "yue": ("big5", "cp950"),
    "ko": ("euc-kr", "cp949"), **dict.fromkeys(("ru", "uk", "kk", "mn"), ("cp1251",)), "ar": ("cp1256",),
    "fa": ("cp1256",), "ur": ("cp1256",), "he": ("cp1255",), "th": ("cp874",), "tr": ("cp1254",), "pl": ("cp1250",),
    "cs": ("cp1250",), "vi": ("cp1258",),
}
#: Encodings tried for every file, after its languages' own; latin-1 decodes any bytes, so it is last.
COMMON_ENCODINGS = ("utf-8", "gb18030", "shift_jis", "euc-kr", "big5", "utf-16-le", "utf-16-be", "cp1252", "latin-1")
_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"),
         (b"\xfe\xff", "utf-16"), (b"\xef\xbb\xbf", "utf-8"))


def _decodes(head: bytes, encoding: str, complete: bool) -> str | None:
    """``head`` decoded, or None when it does not decode (an incomplete last character is no error when
    ``head`` is only the start of the file) or holds NUL characters (no text does: UTF-16 read as bytes)."""
    try:
        text = codecs.getincrementaldecoder(reading_codec(encoding))().decode(head, final=complete)
    except UnicodeDecodeError:
        return None
    return None if "\0" in text else text


def _script_share(text: str, languages: tuple[str, ...]) -> float:
    """Share of the letters beyond ASCII in ``text`` that belong to the scripts of ``languages`` (any
    letter when no language is known); Japanese must show kana, which no other encoding's reading of it
    does."""
    scripts = frozenset().union(*(_SCRIPTS.get(code, frozenset({"LATIN"})) for code in languages))
    counted = found = kana = 0
    for ch in text:
        if ch < "\x80" or unicodedata.category(ch)[0] in "PZ":
            continue  # ASCII reads alike in all of them; punctuation and spaces say little
        counted += 1
        script = unicodedata.name(ch, "?").split(" ")[0]
        kana += script in ("HIRAGANA", "KATAKANA")
        found += (script in scripts) if scripts else unicodedata.category(ch)[0] == "L"
    if not counted:
        return 1.0
    if "ja" in languages and not kana and not {"zh", "zh-Hant", "yue"} & set(languages):
        return 0.0  # Han alone: how GBK or Big5 reads Shift-JIS bytes
    return found / counted


def candidate_encodings(languages: tuple[str, ...]) -> tuple[str, ...]:
    """The encodings :func:`guess_encoding` tries, in order, for text in ``languages``."""
    return tuple(dict.fromkeys(("utf-8", *(n for code in languages for n in _NATIVE.get(code, ())), *COMMON_ENCODINGS)))


def guess_encoding(head: bytes, languages: tuple[str, ...] = (), complete: bool = False) -> str | None:
    """The encoding the bytes ``head`` (a file's start; the whole file when ``complete``) are most likely
    in, for text in ``languages`` (Hunyuan-MT codes; may be empty): a byte order mark's; UTF-16 when
    every other byte is NUL; else the first of the languages' own encodings and
    :data:`COMMON_ENCODINGS` that decodes ``head`` cleanly into text :data:`MOSTLY` in the languages'
    scripts. None when none does."""
    for bom, name in _BOMS:
        if head.startswith(bom):
            return name if _decodes(head, name, complete) is not None else None
    if head and head.count(0) * 10 >= len(head):
        name = "utf-16-le" if head[1::2].count(0) > head[0::2].count(0) else "utf-16-be"
        return name if _decodes(head, name, complete) is not None else None
    for name in candidate_encodings(languages):
        text = _decodes(head, name, complete)
        if text is not None and _script_share(text, languages) >= MOSTLY:
            return name
    return None


def language_codes(labels) -> tuple[str, ...]:
    """The Hunyuan-MT codes of the labels that name one (others, and None, are left out)."""
    return tuple(dict.fromkeys(resolve(label).code for label in labels if label and is_supported(label)))


@dataclass(frozen=True)
class DecodeProblem:
    """Where the text of a file is not in its encoding, and the encoding it reads as (None: no guess)."""

    line: int
    column: int
    byte: int  #: the first byte that did not decode; 0 for a NUL byte in text that has none
    encoding: str
    guess: str | None
    languages: tuple[str, ...]

    def describe(self, where: str, fix: str) -> str:
        """One line: ``where`` (the file) and what is wrong, then ``fix`` (a template for the encoding to
        set, e.g. ``set encoding: {}``) filled with the guess."""
        if self.byte:
            what = f"is not valid {self.encoding} (byte 0x{self.byte:02x} at column {self.column})"
        else:
            what = f"is not {self.encoding} text (NUL byte at column {self.column}, as in UTF-16)"
        if self.guess:
            return f"{where} line {self.line} {what}; it reads as {self.guess}: {fix.format(self.guess)}"
        names = " or ".join(LANGUAGES[code].english_name for code in self.languages)
        return (f"{where} line {self.line} {what}, and reads as {names + ' ' if names else ''}text in none of "
                f"{', '.join(candidate_encodings(self.languages))}: {fix.format('<its encoding>')}")


def decode_problem(head: bytes, encoding: str, languages: tuple[str, ...] = (),
                   complete: bool = False) -> DecodeProblem | None:
    """Why ``head`` (a file's start; the whole file when ``complete``) is not text in ``encoding``: the
    first byte that does not decode, or a NUL byte (valid UTF-8, but a sign of UTF-16) in an encoding
    that keeps ASCII as it is. None when it is."""
    codec = reading_codec(encoding)
    try:
        codecs.getincrementaldecoder(codec)().decode(head, final=complete)
        at = head.find(b"\0") if _lines_end_in_newline_bytes(encoding) else -1
    except UnicodeDecodeError as e:
        at = e.start
    if at < 0:
        return None
    before = head[:at].decode(codec, errors="replace")
    return DecodeProblem(line=before.count("\n") + 1, column=len(before) - before.rfind("\n"), byte=head[at],
                         encoding=encoding, guess=guess_encoding(head, languages, complete), languages=languages)


def read_head(path: str) -> tuple[bytes, bool]:
    """The first :data:`HEAD_BYTES` bytes of a file (decompressed), and whether that is all of it."""
    with open_binary(path) as f:
        head = f.read(HEAD_BYTES)
        return head, not f.read(1)
