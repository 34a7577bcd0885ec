"""The data fingerprint: what a run trained on, saved in every checkpoint and compared on resume.

A fingerprint is a plain JSON-able dict::

    {"sources": [{"path", "format", "src_lang", ..., "files": {stable name: [bytes, content hash]}}],
     "settings": {cleaning, split, tokenizer and row-layout settings},
     "order": {"seed", "epoch_shuffle_rows", "epoch_order"},  # the seeded order, each epoch's lanes
     "prepared": {"path", "id"}}            # only with data.prepared_path: the manifest's id

Files are named as their rows' ``example_id`` names them (relative to the source's root,
``sources.namer``), and compared by size and content hash, never by where they live: the same corpus
mounted elsewhere is the same data. With ``data.prepared_path`` the sources and settings are the ones
the dataset was prepared from (kept in its manifest) and the manifest id says which rows they are.

:func:`compare_fingerprints` says what changed, one line per difference; :func:`check_same_data` turns
differences into one clear error unless ``run.allow_config_change``.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor

from raytrain_hymt.config.schema import PREDATING_VALUES, Config, DataConfig
from raytrain_hymt.config.schema import SourceConfig
from raytrain_hymt.storage import is_uri

log = logging.getLogger(__name__)

#: Source fields that change which rows a source gives (``path`` is recorded but not compared: the
#: files' names, sizes and hashes say whether the data is the same).
SOURCE_FIELDS = ("format", "src_lang", "tgt_lang", "src_column", "tgt_column", "split", "weight")
#: ``data.*`` settings that shape the prepared rows (cleaning, split, prompts, packing, sort).
ROW_SETTINGS = ("min_chars", "max_chars", "max_length_ratio", "drop_identical", "dedup", "on_unsupported_language",
                "val_fraction", "max_val_examples", "both_directions", "max_example_tokens", "packing", "pack_tokens",
                "sort_partitions", "language_id")
#: Hex digits of each file's content hash (blake2b) kept in the fingerprint.
HASH_CHARS = 32


class DataChangedError(ValueError):
    """A run resumed on other data than it was checkpointed with."""


def content_hash(path: str) -> str:
    """blake2b of a file's bytes as stored (a ``.gz`` file is hashed compressed), streamed in 4 MiB reads."""
    h = hashlib.blake2b()
    if is_uri(path):
        import pyarrow.fs as pafs

        fs, inner = pafs.FileSystem.from_uri(path)
        stream = fs.open_input_stream(inner)
    else:
        stream = open(path, "rb")
    with stream as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)  # hashlib releases the GIL on large buffers: files hash in parallel threads
    return h.hexdigest()[:HASH_CHARS]


def source_files(source: SourceConfig) -> list[str]:
    """Every file a source reads (both sides of Moses pairs), as the readers find them."""
    from raytrain_hymt.data.sources import hf_arrow_files, moses_pairs
    from raytrain_hymt.data.files import expand_paths

    if source.format == "moses":
        return [f for pair in moses_pairs(source) for f in pair]
    if source.format in ("hf_disk", "hf_hub"):
        return hf_arrow_files(source)
    return expand_paths(source.path)


def row_settings(data: DataConfig, tokenizer: str) -> dict:
    """The settings that shape the rows, as recorded in a fingerprint."""
    return {"tokenizer": tokenizer, **{k: getattr(data, k) for k in ROW_SETTINGS}}


def sources_fingerprint(cfg: Config) -> dict:
    """Fingerprint of ``data.sources`` and the row settings (hashes every file, in parallel threads)."""
    from raytrain_hymt.data.sources import namer
    from raytrain_hymt.data.files import file_size

    data = cfg.data
    files = [(i, f) for i, source in enumerate(data.sources) for f in source_files(source)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        hashes = list(pool.map(lambda item: content_hash(item[1]), files))
    sources = []
    for i, source in enumerate(data.sources):
        name = namer(source)
        sources.append({"path": source.path, **{k: getattr(source, k) for k in SOURCE_FIELDS}, "files": {
            name(f).stable: [file_size(f), h] for (j, f), h in zip(files, hashes) if j == i}})
    return {"sources": sources, "settings": row_settings(data, cfg.model.tokenizer or cfg.model.name_or_path)}


def data_fingerprint(cfg: Config) -> dict:
    """The fingerprint of the data ``cfg`` trains on: its sources, or its prepared dataset's manifest."""
    # epoch_order names the scheme of data.epochs: a checkpoint of the whole-window permutation before
    # it (no such key) would resume on other batches, so it differs.
    order = {"seed": cfg.data.seed, "epoch_shuffle_rows": cfg.data.epoch_shuffle_rows, "epoch_order": "lanes"}
    if cfg.data.prepared_path:
        from raytrain_hymt.data.prepared import read_manifest

        manifest = read_manifest(cfg.data.prepared_path)
        return {**manifest["fingerprint"], "order": order,
                "prepared": {"path": cfg.data.prepared_path, "id": manifest["id"]}}
    return {**sources_fingerprint(cfg), "order": order}


def _files_diff(where: str, old: dict, new: dict) -> list[str]:
    out = []
    for name in sorted(old.keys() | new.keys()):
        if name not in new:
            out.append(f"{where}: file {name} is gone (was {old[name][0]:,} bytes)")
        elif name not in old:
            out.append(f"{where}: file {name} is new ({new[name][0]:,} bytes)")
        elif old[name] != new[name]:
            (b0, h0), (b1, h1) = old[name], new[name]
            out.append(f"{where}: file {name} changed ({b0:,} → {b1:,} bytes, content hash {h0[:12]} → {h1[:12]})")
    return out


def compare_fingerprints(saved: dict | None, new: dict) -> list[str]:
    """What differs between two fingerprints, one human-readable line each (empty: the same data).
    A checkpoint from before fingerprints (``saved`` None) has nothing to compare."""
    if not saved:
        return []
    out = []
    old_prep, new_prep = saved.get("prepared"), new.get("prepared")
    if (old_prep or {}).get("id") != (new_prep or {}).get("id"):
        def what(p):
            return f"prepared dataset {p['path']} (manifest {p['id'][:12]})" if p else "data.sources read directly"
        out.append(f"data: {what(old_prep)} → {what(new_prep)}")
    old_src, new_src = saved.get("sources", []), new.get("sources", [])
    if len(old_src) != len(new_src):
        out.append(f"data.sources: {len(old_src)} sources → {len(new_src)} "
                   f"({', '.join(s['path'] for s in old_src)} → {', '.join(s['path'] for s in new_src)})")
    for i, (a, b) in enumerate(zip(old_src, new_src)):
        where = f"data.sources[{i}] ({b['path']})"
        out += [f"data.sources[{i}].{k}: {a.get(k)!r} → {b.get(k)!r}" for k in SOURCE_FIELDS if a.get(k) != b.get(k)]
        out += _files_diff(where, a.get("files", {}), b.get("files", {}))
    for group in ("settings", "order"):
        a, b = saved.get(group, {}), new.get(group, {})
        if group == "settings":  # a setting the checkpoint predates: the run trained as before it existed
            a = {**{k.removeprefix("data."): v for k, v in PREDATING_VALUES.items()}, **a}
        out += [f"data.{k}: {a.get(k)!r} → {b.get(k)!r}" if k != "tokenizer" else f"model.tokenizer: {a.get(k)!r} → {b.get(k)!r}"
                for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return out


def check_same_data(saved: dict | None, new: dict, allow_change: bool, where: str = "its last checkpoint") -> list[str]:
    """Compare the fingerprint a run was checkpointed with (``saved``) with the one it resumes on.

    Differences raise :class:`DataChangedError` naming each one and the way out, unless ``allow_change``
    (``run.allow_config_change``): then they are logged as a warning and returned."""
    changes = compare_fingerprints(saved, new)
    if changes and not allow_change:
        raise DataChangedError(
            f"the data differs from the data this run trained on ({where}):\n  " + "\n  ".join(changes)
            + "\nresuming would change the step count and the order, and repeat or skip rows. Resume anyway with "
            "--set run.allow_config_change=true, or start a new run (another --name)"
        )
    if changes:
        log.warning("resuming on changed data (run.allow_config_change):\n  %s", "\n  ".join(changes))
    return changes
