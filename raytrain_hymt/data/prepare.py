"""``hymt prepare``: run the data pipeline once and keep its training rows as Parquet.

Layout of a prepared dataset (a local folder or any pyarrow filesystem URI)::

    <out>/train/<uuid>_<write>_<task:06>.parquet   training rows, in order (file names sort in order)
    <out>/val/...                                  validation rows, in order
    <out>/stats.json                               DataStats + what the rows depend on (``prepared_with``)

``data.prepared_path: <out>`` makes :func:`~raytrain_hymt.data.pipeline.build_datasets` stream these
files instead of reading and tokenizing the sources: same columns, same rows, same order. The rows are
not materialized then; every training worker reads the Parquet files itself (cheap, unlike re-running
tokenization), which is what lets a corpus larger than the object store train.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict

from raytrain_hymt.config import Config
from raytrain_hymt.data.pipeline import DataStats, fill_row_stats, lazy_datasets
from raytrain_hymt.data.readers import DataSourceError, expand_paths

log = logging.getLogger(__name__)

STATS_FILE = "stats.json"


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


def _write_text(path: str, text: str) -> None:
    if "://" in path:
        import pyarrow.fs as pafs

        fs, inner = pafs.FileSystem.from_uri(path)
        with fs.open_output_stream(inner) as f:
            f.write(text.encode())
    else:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _read_text(path: str) -> str:
    from raytrain_hymt.data.readers import open_binary

    with open_binary(path) as f:
        return f.read().decode("utf-8")


def prepare_dataset(cfg: Config, out: str) -> DataStats:
    """Read, clean, tokenize, split, order and pack the configured sources; write the train and
    validation rows to ``<out>/{train,val}`` as Parquet and the statistics to ``<out>/stats.json``."""
    from raytrain_hymt.trainer import init_ray

    if cfg.data.prepared_path:
        raise DataSourceError("data.prepared_path is set: prepare reads data.sources; unset it to prepare again")
    if "://" not in out:
        from pathlib import Path

        out = str(Path(out).expanduser().resolve())
        Path(out).mkdir(parents=True, exist_ok=True)
    init_ray(cfg)
    train, val, stats = lazy_datasets(cfg)
    # Packed from the materialized, ordered examples straight into files: the packed rows are never
    # materialized as a whole.
    train.write_parquet(_join(out, "train"))
    val.write_parquet(_join(out, "val"))
    stats = fill_row_stats(stats, *_read_rows(out))
    record = {"stats": asdict(stats), "prepared_with": prepared_with(cfg)}
    _write_text(_join(out, STATS_FILE), json.dumps(record, indent=1, ensure_ascii=False))
    log.info("prepared dataset written to %s", out)
    return stats


def _file_order(name: str) -> tuple:
    """write_parquet names files ``..._<task index:06>-<file in task>.parquet``; in that numeric order
    they hold the dataset's rows in order (plain string order would put ``-10`` before ``-2``)."""
    m = re.search(r"_(\d+)-(\d+)\.parquet$", name)
    return (int(m.group(1)), int(m.group(2)), name) if m else (-1, -1, name)


def _read_rows(path: str):
    import ray.data

    def read(split: str):
        files = sorted(expand_paths(_join(_join(path, split), "*.parquet"), required=False), key=_file_order)
        if not files:
            raise DataSourceError(f"prepared dataset {path!r}: no Parquet files in {split}/ (was hymt prepare run?)")
        return ray.data.read_parquet(files, shuffle=None)

    return read("train"), read("val")


def read_prepared(cfg: Config):
    """``(train_rows, val_rows, stats)`` streamed from ``data.prepared_path`` (see the module docstring)."""
    import ray.data

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    path = cfg.data.prepared_path
    try:
        record = json.loads(_read_text(_join(path, STATS_FILE)))
    except (FileNotFoundError, OSError) as e:
        raise DataSourceError(f"data.prepared_path {path!r}: no {STATS_FILE} ({e}); run hymt prepare first") from None
    want = prepared_with(cfg)
    diff = {k: (v, want.get(k)) for k, v in record["prepared_with"].items() if want.get(k) != v}
    if diff:
        shown = ", ".join(f"{k}: prepared with {a!r}, configured {b!r}" for k, (a, b) in diff.items())
        raise DataSourceError(f"data.prepared_path {path!r} does not match this config ({shown}); prepare it again")
    train, val = _read_rows(path)
    return train, val, DataStats(**record["stats"])
