"""Prepared datasets: the training rows of one ``hymt prepare`` (:mod:`raytrain_hymt.driver.train`), kept as Parquet.

Layout of a prepared dataset (a local folder or any pyarrow filesystem URI)::

    <out>/manifest.json                         written last: the commit (see below)
    <out>/stats.json                            a copy of the manifest's statistics and settings, for people
    <out>/<write id>/train/<block:06>.parquet   training rows, one block (one lane) a file, in order
    <out>/<write id>/val/<block:06>.parquet     validation rows, in order

Object stores have no rename, so the manifest is the commit: it lists the dataset's files in row
order, with the statistics, the settings the rows depend on (``prepared_with``), the data fingerprint of
the sources it was prepared from, and an ``id`` (a hash of all that). A reader reads the files the
manifest lists and nothing else, never a glob, so a second prepare (or one cut off half-way) can never
mix its rows into the first. A non-empty ``<out>`` is refused unless ``overwrite``; then the new files go
to a fresh ``<write id>`` folder, the new manifest replaces the old one, and only after that is
everything else in ``<out>`` deleted: until the new manifest is written the old dataset stays whole.

``data.prepared_path: <out>`` makes :func:`~raytrain_hymt.data.pipeline.build_datasets` stream these
files instead of reading and tokenizing the sources: same columns, same rows, same order. The rows are
not materialized then; every training rank reads the row groups of its own rows from the Parquet files
itself (:mod:`raytrain_hymt.data.blocks`; ``hymt prepare`` writes row groups of one lane of a window
each), which is what lets a corpus larger than the object store train.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from dataclasses import asdict

from raytrain_hymt.config.schema import Config
from raytrain_hymt.data.epochs import block_rows
from raytrain_hymt.data.files import open_random_access
from raytrain_hymt.data.sources import ReadUnit, read_units
from raytrain_hymt.errors import ConfigError, DataSourceError
from raytrain_hymt.data.stats import DataStats
from raytrain_hymt.storage import is_uri

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
STATS_FILE = "stats.json"
MANIFEST_FORMAT = 1
#: The name of the operator that reads prepared rows back (``Read<name>``; not pairs of a corpus).
PREPARED_READER = "PreparedRows"
#: Blocks being written at once (the stream waits for one to finish beyond that).
_WRITES_IN_FLIGHT = 16


class PreparedDatasetExists(DataSourceError):
    """``hymt prepare`` into a folder that already holds something, without ``--overwrite``."""


def prepared_with(cfg: Config) -> dict:
    """The settings prepared rows depend on that training must agree with (tokenizer, row layout)."""
    return {
        "tokenizer": cfg.model.tokenizer or cfg.model.name_or_path,
        "packing": cfg.data.packing,
        "pack_tokens": cfg.data.pack_tokens if cfg.data.packing else None,
        "max_example_tokens": cfg.data.max_example_tokens,
    }


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def filesystem(path: str):
    """``(pyarrow filesystem, path on it)`` of a local path or URI."""
    import pyarrow.fs as pafs

    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), path


def _write_text(path: str, text: str) -> None:
    """Write a file whole: a local file through a rename, an object in one upload."""
    if is_uri(path):
        fs, inner = filesystem(path)
        with fs.open_output_stream(inner) as f:
            f.write(text.encode())
    else:
        import os

        with open(path + ".partial", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(path + ".partial", path)


def _read_text(path: str) -> str:
    from raytrain_hymt.data.files import open_binary

    with open_binary(path) as f:
        return f.read().decode("utf-8")


def _entries(out: str) -> list:
    """What ``out`` holds at its top level ([] when it does not exist)."""
    import pyarrow.fs as pafs

    fs, inner = filesystem(out)
    return fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))


def _write_block(block, fs, path: str) -> None:
    """Write one block as the Parquet file ``path`` of ``fs``, one row group (in a Ray task)."""
    import pyarrow.parquet as pq
    from ray.data.block import BlockAccessor

    pq.write_table(BlockAccessor.for_block(block).to_arrow(), path, filesystem=fs)


def _write_in_order(rows, out: str, folder: str) -> tuple[list[str], int]:
    """Write block n of ``rows`` (a Ray Dataset) as ``<folder>/<n:06>.parquet`` of ``out``, a few blocks at
    a time in Ray tasks: the files' names, relative to ``out``, in row order, and the number of rows.

    The order is the one ``iter_internal_ref_bundles`` gives, the one a training rank reads from the
    object store (:mod:`raytrain_hymt.data.blocks`). Not ``Dataset.write_parquet``: it numbers files by
    write task, and Ray 2.60's Parquet sink writes the blocks of one task with pyarrow's threaded
    ``write_dataset`` without ``preserve_order``, which may write them in another order
    (tests/integration/test_pipeline.py shows it); a prepared dataset once gave other batches than the object store
    in a CI run of tests/integration/test_rank_reading.py."""
    import pyarrow.fs as pafs
    import ray

    fs, inner = filesystem(_join(out, folder))  # resolved here, as for the manifest: one set of credentials
    if isinstance(fs, pafs.LocalFileSystem):  # object stores have no folders
        fs.create_dir(inner, recursive=True)
    write = ray.remote(_write_block)
    names, pending, count = [], [], 0
    # A DeveloperAPI with no public equivalent in Ray 2.60.0 (checked there: bundles of whole blocks, each
    # entry's ``ref`` and ``metadata.num_rows``); tests/integration/test_pipeline.py fails if that changes.
    for bundle in rows.iter_internal_ref_bundles():
        for entry in bundle.blocks:
            if entry.metadata.num_rows == 0:  # an empty block makes no file
                continue
            name = f"{len(names):06}.parquet"
            names.append(f"{folder}/{name}")
            pending.append(write.remote(entry.ref, fs, _join(inner, name)))
            count += entry.metadata.num_rows
            if len(pending) >= _WRITES_IN_FLIGHT:  # the stream waits, holding few blocks
                done, pending = ray.wait(pending, num_returns=1)
                ray.get(done)
    ray.get(pending)
    return names, count


def _manifest_id(record: dict) -> str:
    return hashlib.blake2b(json.dumps(record, sort_keys=True).encode(), digest_size=16).hexdigest()


def write_prepared(cfg: Config, out: str, train, val, stats: DataStats, fingerprint: dict) -> DataStats:
    """Write ``train``/``val`` (Ray Datasets) as Parquet into a fresh folder of ``out``, then commit them
    with a new manifest and delete what an earlier dataset left; the statistics with the row counts."""
    write_id, started = f"w-{uuid.uuid4().hex[:12]}", time.monotonic()
    # Packed from the materialized, ordered examples straight into files: the packed rows are never
    # materialized as a whole. Files of one lane each (data.blocks): a training rank reads only the
    # files of its own lanes.
    group = block_rows(cfg, stats)
    train = train.repartition(target_num_rows_per_block=group, strict=True)
    files, counts = {}, {}
    for split, rows in (("train", train), ("val", val)):
        files[split], counts[split] = _write_in_order(rows, out, f"{write_id}/{split}")
    stats.train_rows, stats.val_rows = counts["train"], counts["val"]
    log.info("data: %d training rows and %d validation rows packed and written (%.0f s)", stats.train_rows,
             stats.val_rows, time.monotonic() - started)
    record = {"format": MANIFEST_FORMAT, "files": files, "stats": asdict(stats), "prepared_with": prepared_with(cfg),
              "fingerprint": fingerprint}
    manifest = {"id": _manifest_id(record), **record}
    _write_text(_join(out, MANIFEST_FILE), json.dumps(manifest, indent=1, ensure_ascii=False))  # the commit
    _write_text(_join(out, STATS_FILE), json.dumps({"stats": manifest["stats"], "prepared_with": manifest["prepared_with"]},
                                                   indent=1, ensure_ascii=False))
    _delete_all_but(out, {MANIFEST_FILE, STATS_FILE, write_id})
    log.info("prepared dataset written to %s (manifest %s)", out, manifest["id"])
    return stats


def check_target(out: str, overwrite: bool) -> None:
    """Refuse a non-empty ``out`` unless ``overwrite`` (a second dataset is never mixed into a first)."""
    entries = _entries(out)
    if entries and not overwrite:
        names = sorted(e.base_name for e in entries)
        what = ("a prepared dataset" if MANIFEST_FILE in names
                else f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: {', '.join(names[:5])}")
        raise PreparedDatasetExists(
            f"OUT: {out} is not empty ({what}); a second dataset is never mixed into it: pass --overwrite to "
            "replace it, or prepare into an empty or new folder"
        )


def _delete_all_but(out: str, keep: set[str]) -> None:
    """Remove what an earlier dataset left in ``out`` (after the new manifest no reader sees it)."""
    import pyarrow.fs as pafs

    fs, _ = filesystem(out)
    for entry in _entries(out):
        if entry.base_name not in keep:
            if entry.type == pafs.FileType.Directory:
                fs.delete_dir(entry.path)
            else:
                fs.delete_file(entry.path)


def _row_groups(path: str):
    """The row groups of one Parquet file, in order, one table each."""
    import pyarrow.parquet as pq

    with open_random_access(path) as f:
        pf = pq.ParquetFile(f)
        for group in range(pf.num_row_groups):
            yield pf.read_row_group(group)


def read_parquet_in_order(paths: list[str]):
    """The rows of the Parquet files ``paths`` as a Ray Dataset, in file order: one read task per file,
    one block per row group.

    Not ``ray.data.read_parquet``: Ray 2.60's Parquet reader (its datasource v2) bin-packs the files into
    read tasks in the order their footers come back from a pool of actors, so its rows need not come in
    the files' order (a prepared dataset read back that way once failed the round-trip test in CI)."""
    return read_units([ReadUnit(lambda p=p: _row_groups(p), (p,)) for p in paths], schema=None, name=PREPARED_READER)


def _read_files(path: str, files: dict[str, list[str]]):
    """The train and validation rows of the manifest's ``files``, streamed from Parquet in order."""
    import ray.data

    def read(split: str):
        if not files[split]:
            if split == "val":  # data.val_fraction 0: no validation rows, no files
                return ray.data.from_items([])
            raise DataSourceError(f"prepared dataset {path!r}: its manifest lists no {split} files")
        return read_parquet_in_order([_join(path, f) for f in files[split]])

    return read("train"), read("val")


def read_manifest(path: str) -> dict:
    """The manifest of the prepared dataset at ``path``; a clear error when there is none."""
    try:
        return json.loads(_read_text(_join(path, MANIFEST_FILE)))
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(  # a config field naming the wrong folder: found before Ray starts, exit 2
            f"data.prepared_path {path!r}: no {MANIFEST_FILE} ({e}): not a prepared dataset, one whose "
            "prepare did not finish, or one from before manifests; run hymt prepare (with --overwrite) first"
        ) from None


def row_groups(path: str, split: str) -> tuple[list[str], list[tuple[int, int]], list[int]]:
    """The row groups of the prepared dataset at ``path``'s ``split`` (``train`` or ``val``), in row order,
    from the Parquet footers: ``(files, [(file index, row group)], [rows])``."""
    import pyarrow.parquet as pq

    files = [_join(path, f) for f in read_manifest(path)["files"][split]]
    groups, rows = [], []
    for i, name in enumerate(files):
        fs, inner = filesystem(name)
        with fs.open_input_file(inner) as f:
            meta = pq.ParquetFile(f).metadata
        for g in range(meta.num_row_groups):
            groups.append((i, g))
            rows.append(meta.row_group(g).num_rows)
    return files, groups, rows


def read_prepared(cfg: Config):
    """``(train_rows, val_rows, stats)`` streamed from ``data.prepared_path`` (see the module docstring)."""
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    path = cfg.data.prepared_path
    record = read_manifest(path)
    want = prepared_with(cfg)
    diff = {k: (v, want.get(k)) for k, v in record["prepared_with"].items() if want.get(k) != v}
    if diff:
        shown = ", ".join(f"{k}: prepared with {a!r}, configured {b!r}" for k, (a, b) in diff.items())
        raise DataSourceError(f"data.prepared_path {path!r} does not match this config ({shown}); prepare it again")
    train, val = _read_files(path, record["files"])
    return train, val, DataStats(**record["stats"])
