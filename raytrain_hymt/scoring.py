"""Translation scores (sacrebleu) and the evaluation history they are kept in. Pure: no Ray, no torch.

Scores of one direction: BLEU (tokenized for the target language: ``zh`` for Chinese, characters for
Japanese/Thai/Khmer/Burmese, ``13a`` otherwise), chrF, chrF++ (chrF with word bigrams) and TER (with
``asian_support``, which needs sacrebleu's normalization, for Chinese and Japanese targets), each with sacrebleu's signature, which says exactly
what was measured.

History: every evaluation of a test set gets a folder of its own, ``<eval root>/<set>/<time>/``
(``scores.json`` and the translations, ``<src>-<tgt>.hyp``), and one line in ``<eval root>/<set>/history.jsonl``
(the same record as scores.json plus the folder's name), so a new evaluation never replaces an older one.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

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
