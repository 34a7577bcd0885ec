"""Test sets and translation scores: what evaluation, ``hymt translate`` and BLEU during training share.
Pure: no Ray, no torch.

Test sets: a folder of line-aligned files, one per language (FLORES-200's ``devtest/``), and the rows to
translate from it.

Scores of one direction: BLEU (tokenized for the target language: ``zh`` for Chinese, characters for
Japanese/Thai/Khmer/Burmese, ``13a`` otherwise), chrF, chrF++ (chrF with word bigrams) and TER (with
``asian_support``, which needs sacrebleu's normalization, for Chinese and Japanese targets), each with
sacrebleu's signature, which says exactly what was measured.

History: every evaluation of a test set gets a folder of its own, ``<eval root>/<set>/<time>/``
(``scores.json`` and the translations, ``<src>-<tgt>.hyp``), and one line in
``<eval root>/<set>/history.jsonl`` (the same record as scores.json plus the folder's name), so a new
evaluation never replaces an older one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from raytrain_hymt.errors import ConfigError
from raytrain_hymt.languages import is_supported, parse_direction, resolve

SCORES_FILE = "scores.json"
HISTORY_FILE = "history.jsonl"

#: The metrics of :func:`score`, in the order tables print them.
METRICS = ("bleu", "chrf", "chrfpp", "ter")

# Target languages written without spaces between words: 13a would score whole sentences as one token.
_BLEU_TOKENIZE = {"zh": "zh", "zh-Hant": "zh", "yue": "zh", "ja": "char", "th": "char", "km": "char", "my": "char"}
# sacrebleu's TER knows Chinese and Japanese punctuation and characters only (asian_support).
_TER_ASIAN = {"zh", "zh-Hant", "yue", "ja"}


def bleu_tokenizer(target_code: str) -> str:
    """sacrebleu's ``tokenize`` for BLEU on ``target_code`` text (chrF needs none)."""
    return _BLEU_TOKENIZE.get(target_code, "13a")


def score(hypotheses: list[str], references: list[str], target_code: str) -> dict:
    """Corpus BLEU, chrF, chrF++ and TER of one direction, with sacrebleu's signatures."""
    import sacrebleu

    asian = target_code in _TER_ASIAN
    metrics = {
        "bleu": sacrebleu.metrics.BLEU(tokenize=bleu_tokenizer(target_code)),
        "chrf": sacrebleu.metrics.CHRF(),
        "chrfpp": sacrebleu.metrics.CHRF(word_order=2),
        # sacrebleu applies asian_support only inside its normalization step (normalized=True): without
        # it a Chinese sentence stays one "word" and TER is 0 or 100.
        "ter": sacrebleu.metrics.TER(normalized=asian, asian_support=asian),
    }
    out: dict = {}
    for name, metric in metrics.items():
        out[name] = metric.corpus_score(hypotheses, [references]).score
    out["sentences"] = len(hypotheses)
    out.update({f"{name}_signature": str(metric.get_signature()) for name, metric in metrics.items()})
    return out


def new_evaluation_dir(set_root: Path) -> Path:
    """A fresh ``<set_root>/<UTC time>/`` folder (``20261201T094531Z``; ``-2``... when taken this second)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out, n = set_root / stamp, 1
    while out.exists():
        n += 1
        out = set_root / f"{stamp}-{n}"
    out.mkdir(parents=True)
    return out


def record_evaluation(out_dir: Path, record: dict, translations: dict[str, list[str]]) -> None:
    """Write ``scores.json`` (``record``) and ``<direction>.hyp`` files into ``out_dir`` (from
    :func:`new_evaluation_dir`), and append the record with its folder name to the set's history.jsonl."""
    for direction, hyps in translations.items():
        (out_dir / f"{direction}.hyp").write_text("".join(h.replace("\n", " ") + "\n" for h in hyps), encoding="utf-8")
    (out_dir / SCORES_FILE).write_text(json.dumps(record, indent=1, ensure_ascii=False), encoding="utf-8")
    with (out_dir.parent / HISTORY_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"dir": out_dir.name, **record}, ensure_ascii=False) + "\n")


def read_history(set_root: Path) -> list[dict]:
    """The records of ``<set_root>/history.jsonl``, oldest first ([] when none)."""
    path = set_root / HISTORY_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


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
