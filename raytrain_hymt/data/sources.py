"""A configured source as read tasks: which files (Moses pairs, Hugging Face Arrow shards, globs) with
which reader (:mod:`raytrain_hymt.data.readers`), each a ``ReadUnit``, and the streaming Ray Dataset
that runs them, one read task per unit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from raytrain_hymt.config.schema import SourceConfig
from raytrain_hymt.data.files import FileName, count_lines, expand_paths, file_name, source_root
from raytrain_hymt.data.readers import (PAIR_SCHEMA, Columns, arrow_stream_batches, delimited_parser, parquet_batches,
                                        read_batches, read_csv, read_jsonl, read_line_tables, read_moses,
                                        tatoeba_parser)
from raytrain_hymt.errors import DataSourceError
from raytrain_hymt.languages import direction_text

log = logging.getLogger(__name__)


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


def check_moses_line_counts(pairs: list[tuple[str, str]], encoding: str = "utf-8") -> None:
    """Count the lines of every Moses file pair (text in ``encoding``) in parallel Ray tasks (a fast
    pre-pass when the dataset is planned, before any training) and raise :class:`DataSourceError` naming
    both files and both counts when a pair differs."""
    import ray

    counter = ray.remote(num_cpus=0.5)(count_lines)
    files = [f for pair in pairs for f in pair]
    counts = dict(zip(files, ray.get([counter.remote(f, encoding) for f in files])))
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
        check_moses_line_counts(pairs, source.encoding)
        return [ReadUnit(lambda s=s, t=t: read_moses(s, t, source_index, src_lang, tgt_lang, name(s), name(t),
                                                     source.encoding), (s, t))
                for s, t in pairs]
    if fmt in ("hf_disk", "hf_hub"):
        files = hf_arrow_files(source)
    else:
        files = expand_paths(source.path)

    if fmt == "tatoeba":
        if source.src_lang or source.tgt_lang:
            log.info("data.sources[%d] (%s): rows are read as %s (src_lang, tgt_lang): rows labelled %s are swapped, "
                     "rows in other languages are dropped as other_languages", source_index, source.path,
                     direction_text(source.src_lang, source.tgt_lang), direction_text(source.tgt_lang, source.src_lang))
        parse = tatoeba_parser(source.src_lang, source.tgt_lang)
        return [ReadUnit(lambda p=p: read_line_tables(p, source_index, parse, name(p), source.encoding), (p,))
                for p in files]
    src_lang, tgt_lang = _languages(source)
    if fmt == "tsv":
        parse = delimited_parser("\t", src_lang, tgt_lang)
        return [ReadUnit(lambda p=p: read_line_tables(p, source_index, parse, name(p), source.encoding), (p,))
                for p in files]
    if fmt == "csv":
        return [ReadUnit(lambda p=p: read_csv(p, source_index, src_lang, tgt_lang, name(p), source.encoding), (p,))
                for p in files]
    columns = Columns(source.src_column, source.tgt_column, src_lang, tgt_lang)
    if fmt == "jsonl":
        return [ReadUnit(lambda p=p: read_jsonl(p, source_index, columns, name(p), source.encoding), (p,))
                for p in files]
    if fmt == "parquet":
        return [ReadUnit(lambda p=p: read_batches(parquet_batches(p, columns), source_index, columns, name(p)), (p,))
                for p in files]
    return [ReadUnit(lambda p=p: read_batches(arrow_stream_batches(p), source_index, columns, name(p)), (p,)) for p in files]


def _planned_datasource(units: list[ReadUnit], schema, name: str):
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class PlannedFiles(Datasource):
        """One Ray read task per :class:`ReadUnit`, in plan order."""

        def get_name(self):
            return name

        def estimate_inmemory_data_size(self):
            return None

        def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
            tasks = []
            for unit in units:
                meta = BlockMetadata(num_rows=None, size_bytes=None, input_files=list(unit.files), exec_stats=None)
                tasks.append(ReadTask(unit.read, meta, schema=schema, per_task_row_limit=per_task_row_limit))
            return tasks

    return PlannedFiles()


def read_units(units: list[ReadUnit], schema=PAIR_SCHEMA, name: str = "PlannedFiles"):
    """Planned read tasks as a Ray Dataset (pairs by default): one read task per unit, streamed in
    blocks, in plan order (with ``preserve_order``); ``name``: the read operator's (``Read<name>``)."""
    import ray.data

    return ray.data.read_datasource(_planned_datasource(units, schema, name), override_num_blocks=len(units))


def read_source(source: SourceConfig, source_index: int):
    """One configured source as a Ray Dataset of pairs (one read task per file, streamed in blocks)."""
    return read_units(plan_source(source, source_index))
