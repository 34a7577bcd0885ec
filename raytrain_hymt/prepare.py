"""``hymt prepare``: run the data pipeline once and keep its training rows as a prepared dataset
(Parquet files and a manifest: :mod:`raytrain_hymt.data.prepared`), which ``data.prepared_path`` trains
from without reading or tokenizing the sources again."""

from __future__ import annotations

from pathlib import Path

from raytrain_hymt.config import Config
from raytrain_hymt.data.fingerprint import sources_fingerprint
from raytrain_hymt.data.pipeline import lazy_datasets
from raytrain_hymt.data.prepared import check_target, write_prepared
from raytrain_hymt.errors import DataSourceError
from raytrain_hymt.data.stats import DataStats
from raytrain_hymt.session import init_ray
from raytrain_hymt.storage import is_uri


def prepare_dataset(cfg: Config, out: str, overwrite: bool = False) -> DataStats:
    """Read, clean, tokenize, split, order and pack the configured sources and publish them as a
    prepared dataset in ``out`` (see the module docstring); ``overwrite`` replaces what ``out`` holds."""
    if cfg.data.prepared_path:
        raise DataSourceError("data.prepared_path is set: prepare reads data.sources; unset it to prepare again")
    if not is_uri(out):
        out = str(Path(out).expanduser().resolve())
    check_target(out, overwrite)  # before Ray starts or any file is read
    fingerprint = sources_fingerprint(cfg)
    if not is_uri(out):
        Path(out).mkdir(parents=True, exist_ok=True)
    init_ray(cfg)
    train, val, stats = lazy_datasets(cfg)
    return write_prepared(cfg, out, train, val, stats, fingerprint)
