"""Test sets: a folder of line-aligned files, one per language (FLORES-200's ``devtest/``), the rows to
translate from it, and the scores of their translations. Pure logic: what evaluation, ``hymt translate``
and BLEU during training share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from raytrain_hymt.errors import ConfigError
from raytrain_hymt.languages import is_supported, parse_direction, resolve
from raytrain_hymt.scoring import score


@dataclass
class TestSet:
    """A multi-way test set: one file per language, the same number of lines in each."""

    folder: str
    files: dict[str, Path]
    """Canonical language code → its file."""
    lines: int

    @property
    def name(self) -> str:
        """The folder's name (``devtest``), used in metric names and output folders."""
        return Path(self.folder).name


def read_sentences(path: Path) -> list[str]:
    """The file's lines without their line ends (one sentence per line). Only ``\n`` (or ``\r\n``) ends
    a line: ``str.splitlines`` would also split at form feeds or U+2028 inside a sentence and shift
    every later hypothesis against its reference."""
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def load_test_set(folder: str) -> TestSet:
    """Find the language files in ``folder`` and check they are line-aligned; ConfigError says what is wrong."""
    root = Path(folder).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"eval.test_set: {folder} is not a folder (expected one file per language, "
                          "e.g. FLORES-200's devtest/ with eng_Latn.devtest, zho_Hans.devtest)")
    files: dict[str, Path] = {}
    for path in sorted(root.iterdir()):
        label = path.name.split(".")[0]
        if not path.is_file() or path.name.startswith(".") or not is_supported(label):
            continue  # README, SOURCE.md, LICENSE...
        code = resolve(label).code
        if code in files:
            raise ConfigError(f"eval.test_set: {files[code].name} and {path.name} in {root} are both {code}")
        files[code] = path
    if not files:
        raise ConfigError(f"eval.test_set: no file in {root} is named by a language (e.g. eng_Latn.devtest, en.txt)")
    counts = {code: len(read_sentences(path)) for code, path in files.items()}
    empty = [files[c].name for c, n in counts.items() if n == 0]
    if empty:
        raise ConfigError(f"eval.test_set: {', '.join(empty)} in {root} has no lines")
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{files[c].name}: {n}" for c, n in counts.items())
        raise ConfigError(f"eval.test_set: the files in {root} are not line-aligned ({listing} lines)")
    return TestSet(folder=str(root), files=files, lines=next(iter(counts.values())))


def plan_rows(test_set: TestSet, directions: list[str], max_sentences: int | None) -> list[dict]:
    """One row per sentence to translate: ``{id, direction, index, src, ref, src_lang, tgt_lang}``.

    Every requested language must have a file; ``max_sentences`` keeps the first lines of each direction.
    """
    rows: list[dict] = []
    cache: dict[str, list[str]] = {}
    for direction in directions:
        src, tgt = parse_direction(direction)
        missing = [c for c in (src, tgt) if c not in test_set.files]
        if missing:
            raise ConfigError(f"eval.directions: {direction} needs {' and '.join(missing)}, but {test_set.folder} "
                              f"has only {', '.join(sorted(test_set.files))}")
        for code in (src, tgt):
            cache.setdefault(code, read_sentences(test_set.files[code]))
        n = min(test_set.lines, max_sentences or test_set.lines)
        key, first = f"{src}-{tgt}", len(rows)
        rows.extend({"id": first + i, "direction": key, "index": i, "src": cache[src][i], "ref": cache[tgt][i],
                     "src_lang": src, "tgt_lang": tgt} for i in range(n))
    return rows


def score_rows(rows: list[dict], hyps: list[str]) -> tuple[dict[str, dict], dict[str, list[str]]]:
    """Scores per direction of ``hyps`` (one per :func:`plan_rows` row), and each direction's hypotheses."""
    scores, translations = {}, {}
    for direction in dict.fromkeys(r["direction"] for r in rows):
        picked = [(h, r) for h, r in zip(hyps, rows) if r["direction"] == direction]
        translations[direction] = [h for h, _ in picked]
        scores[direction] = score(translations[direction], [r["ref"] for _, r in picked], picked[0][1]["tgt_lang"])
    return scores, translations
