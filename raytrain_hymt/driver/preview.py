"""``hymt preview``: the first training examples of a config's sources as the model sees them.

Each example is read, cleaned, split, turned into one or both directions (``pipeline.prepare_pairs``) and
tokenized through the chat template (``tokenize.TokenizePairs``): the very functions the Ray Data pipeline
maps over every block, called here in this process on the first rows of each source, without Ray. What
the pipeline does after them (deduplication, source weights, the seeded shuffle, packing) changes which
examples train and in what order, never what one example holds, so the preview shows the examples in file
order, each pair's reverse right after it.

Each example is its decoded tokens, special tokens included; the part the loss skips (labels -100: the
chat-templated prompt) is wrapped in ``⟦…⟧`` (also dimmed on a terminal), the trained part is plain.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from raytrain_hymt.config.schema import Config, SourceConfig
from raytrain_hymt.errors import ConfigError

#: Rows cleaned and tokenized at a time: a preview needs a few, a file's first block holds thousands.
CHUNK_ROWS = 64
MASK_OPEN, MASK_CLOSE = "⟦", "⟧"
_DIM, _RESET = "\x1b[2m", "\x1b[0m"
#: What a row that is not trained on says instead of its tokens.
_SKIP_WHY = {"validation": "held out for validation (data.val_fraction)"}


@dataclass
class Example:
    """One tokenized example, or a row that does not train (``skipped`` says why)."""

    origin: str
    """``file:line`` (``file:row`` for Parquet and Arrow) of the corpus row."""
    direction: str
    """``en→zh``: the languages of the example's prompt and answer."""
    reversed: bool
    """The pair read the other way round (``data.both_directions``)."""
    pieces: list[tuple[str, bool]]
    """The decoded tokens in runs: ``(text, trained)``."""
    skipped: str = ""

    def lines(self, color: bool = False) -> list[str]:
        """The header line and the text; the masked part in ``⟦…⟧`` (and dimmed with ``color``)."""
        turned = ", reversed" if self.reversed else ""
        if self.skipped:
            return [f"{self.origin}  {self.direction}{turned}  not trained: {_SKIP_WHY.get(self.skipped, self.skipped)}"]
        text = "".join(t if trained else f"{_DIM if color else ''}{MASK_OPEN}{t}{MASK_CLOSE}{_RESET if color else ''}"
                       for t, trained in self.pieces)
        return [f"{self.origin}  {self.direction}{turned}", text]


def _runs(ids: list[int], labels: list[int]) -> Iterator[tuple[list[int], bool]]:
    """``ids`` in runs of equal maskedness: ``(ids, trained)``."""
    from raytrain_hymt.data.packing import IGNORE_INDEX

    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or (labels[i] == IGNORE_INDEX) != (labels[start] == IGNORE_INDEX):
            yield ids[start:i], labels[start] != IGNORE_INDEX
            start = i


def _units(source: SourceConfig, index: int):
    """The read units of one source, as the pipeline plans them. Moses pairs are read as ``plan_source``
    reads them, without its line count in Ray tasks: ``check_inputs`` compared the counts already."""
    from raytrain_hymt.data.readers import read_moses
    from raytrain_hymt.data.sources import ReadUnit, moses_pairs, namer, plan_source

    if source.format != "moses":
        return plan_source(source, index)
    name, src_lang, tgt_lang = namer(source), source.src_lang, source.tgt_lang  # set: check_inputs saw to it
    return [ReadUnit(lambda s=s, t=t: read_moses(s, t, index, src_lang, tgt_lang, name(s), name(t), source.encoding),
                     (s, t)) for s, t in moses_pairs(source)]


def _chunks(cfg: Config) -> Iterator[dict[str, np.ndarray]]:
    """The configured sources' rows in order, ``CHUNK_ROWS`` at a time, as the NumPy batches Ray Data
    hands ``prepare_pairs``."""
    for index, source in enumerate(cfg.data.sources):
        for unit in _units(source, index):
            for table in unit.read():
                for start in range(0, table.num_rows, CHUNK_ROWS):
                    chunk = table.slice(start, CHUNK_ROWS)
                    yield {name: chunk[name].to_numpy(zero_copy_only=False) for name in chunk.column_names}


def preview_examples(cfg: Config, n: int) -> list[Example]:
    """The first ``n`` training examples of ``cfg``'s sources, with every row before them that does not
    train (dropped by cleaning, too long, held out for validation) in its place."""
    from raytrain_hymt.data.pipeline import cleaning_rules, prepare_pairs
    from raytrain_hymt.data.prompts import resolve_family
    from raytrain_hymt.data.tokenize import TokenizePairs

    data = cfg.data
    tokenizer_name = cfg.model.tokenizer or cfg.model.name_or_path
    tokenize = TokenizePairs(tokenizer_name, data.max_example_tokens, cfg.model.trust_remote_code,
                             resolve_family(cfg.model.family, tokenizer_name))
    decode = tokenize.tokenizer.decode
    out: list[Example] = []
    trained = 0
    for batch in _chunks(cfg):
        order = {int(e): i for i, e in enumerate(batch["example_id"])}
        origins = batch["origin"]
        pairs = prepare_pairs(batch, cleaning_rules(data), data.seed, data.val_fraction, data.both_directions)
        table = tokenize(pairs).to_pydict()
        rows = sorted(range(len(table["example_id"])), key=lambda j: (order[table["example_id"][j]], table["direction"][j]))
        for j in rows:
            reason = table["drop_reason"][j] or ("validation" if table["is_val"][j] else "")
            example = Example(origin=str(origins[order[table["example_id"][j]]]),
                              direction=f"{pairs['src_lang'][j]}→{pairs['tgt_lang'][j]}",
                              reversed=bool(table["direction"][j]), pieces=[], skipped=reason)
            if not reason:
                example.pieces = [(decode(ids, skip_special_tokens=False), on)
                                  for ids, on in _runs(table["input_ids"][j], table["labels"][j])]
                trained += 1
            out.append(example)
            if trained == n:
                return out
    return out


def _groups(examples: list[Example]) -> Iterator[list[Example]]:
    """Consecutive rows of one file skipped for one reason together (a corpus may open with hundreds); every
    other example alone."""
    group: list[Example] = []
    for e in examples:
        if group and not (e.skipped and e.skipped == group[-1].skipped
                          and e.origin.rsplit(":", 1)[0] == group[-1].origin.rsplit(":", 1)[0]):
            yield group
            group = []
        group.append(e)
    if group:
        yield group


def _skipped_rows(group: list[Example]) -> str:
    """``file:1-6  6 rows not trained: unsupported_language``."""
    first, last = group[0].origin, group[-1].origin.rsplit(":", 1)[1]
    return f"{first}-{last}  {len(group)} rows not trained: {_SKIP_WHY.get(group[0].skipped, group[0].skipped)}"


def run_preview(cfg: Config, n: int, color: bool = False) -> str:
    """``hymt preview``'s text: a line on the marking, then each example (or skipped row) of
    :func:`preview_examples`, a blank line between examples."""
    from raytrain_hymt.data.preflight import check_inputs

    if cfg.data.prepared_path:
        raise ConfigError(f"data.prepared_path: {cfg.data.prepared_path} holds tokenized rows without their source "
                          "lines; hymt preview reads data.sources (preview the config the dataset was prepared from)")
    check_inputs(cfg)
    examples = preview_examples(cfg, n)
    found = sum(1 for e in examples if not e.skipped)
    head = (f"{found} training example{'s' if found != 1 else ''} of data.sources in file order, as tokenized for "
            f"training; {MASK_OPEN}…{MASK_CLOSE}: masked from the loss (labels -100), the rest is trained")
    blocks = [_skipped_rows(group) if len(group) > 1 else "\n".join(group[0].lines(color)) for group in _groups(examples)]
    more = [] if found == n else [f"(the sources hold no more training examples than these {found})"]
    return "\n\n".join([head, *blocks, *more]) + "\n"
