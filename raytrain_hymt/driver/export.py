"""``hymt export``'s driver side: check the checkpoint before anything starts, then export it in this
process, or in a Ray task on a cluster.

Where the export runs. It streams tensor by tensor (``train.export.export_checkpoint``: DeepSpeed's lazy
``zero_to_fp32`` for ZeRO-1/2/3, the LoRA merge onto a base read one tensor at a time), so one process holds
about two shards plus the libraries at any model size and ZeRO stage: on one machine Ray adds nothing but
its start (tens of seconds before the first tensor is read), because its task ran on this same machine
anyway. A checkpoint in bucket storage needs no Ray either: the task copied it to its node's disk before
reading it, and this process makes the same copy on this machine. Only a cluster (``RAY_ADDRESS``, as
under ``ray job submit``) keeps the Ray task: there the checkpoint's path, the memory and the disk that
count are the cluster's, not those of the machine that submitted the command.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from raytrain_hymt.errors import ConfigError
from raytrain_hymt.storage import CONFIG_FILE, is_uri

log = logging.getLogger("raytrain_hymt")


@dataclass
class ExportResult:
    """What ``hymt export`` wrote and what it took."""

    checkpoint: str
    """The checkpoint exported (a run folder's newest whole one when a run folder was given)."""
    out: str
    peak_gib: float
    """Peak memory of the process that exported: the Ray task's, or this process's."""
    on_ray: bool


def on_cluster() -> bool:
    """Whether the export runs as a Ray task: only when ``RAY_ADDRESS`` names a cluster to join."""
    return bool(os.environ.get("RAY_ADDRESS"))


def _absolute(path: str | None) -> str | None:
    # Resolved here, so a relative path means the same folder in a task as on the command line.
    return path if path is None or is_uri(path) else os.path.abspath(os.path.expanduser(path))


def _filesystem(path: str):
    import pyarrow.fs

    if is_uri(path):
        return pyarrow.fs.FileSystem.from_uri(path)
    return pyarrow.fs.LocalFileSystem(), path


def resolve_checkpoint(path: str):
    """``(checkpoint, its run state)`` to export for ``path`` (a folder or URI): the checkpoint itself after
    checking it is whole, or a run folder's newest whole checkpoint. Reads only listings and a few small files
    (also in bucket storage), so every mistake is found before Ray starts; raises ``ConfigError``, one line."""
    import pyarrow.fs

    from raytrain_hymt.train.checkpoint import (IncompleteCheckpointError, check_checkpoint, list_checkpoints,
                                                newest_whole_checkpoint)

    fs, where = _filesystem(path)
    where = where.rstrip("/")
    names = list_checkpoints(fs, where)
    if names:  # a run folder
        found = newest_whole_checkpoint(fs, where, warn=False)
        if found is None:
            try:
                check_checkpoint(fs, f"{where}/{names[0]}")
            except IncompleteCheckpointError as e:
                newest = str(e)
            raise ConfigError(f"{path}: none of the run's {len(names)} checkpoints is whole; the newest: {newest}")
        if found[0] != names[0]:
            log.warning("exporting %s: the run's newer %s was cut off", found[0], ", ".join(names[:names.index(found[0])]))
        return f"{path.rstrip('/')}/{found[0]}", found[1]
    if fs.get_file_info(f"{where}/{CONFIG_FILE}").type == pyarrow.fs.FileType.File:
        raise ConfigError(f"{path} is a run folder without checkpoints (no checkpoint_step* folder: the run saved "
                          "none yet; checkpoint.every_steps sets how often it saves)")
    try:
        return path, check_checkpoint(fs, where)
    except IncompleteCheckpointError as e:
        raise ConfigError(str(e)) from None


def check_export(checkpoint: str, state, out: str) -> None:
    """What can be refused before the export starts, beyond the checkpoint itself: a LoRA checkpoint whose
    base changed, and an output folder that export would replace although it holds no model."""
    from raytrain_hymt.train.checkpoint import BaseModelMismatchError, check_base_model
    from raytrain_hymt.train.export import check_export_target

    if not is_uri(out):
        try:
            check_export_target(Path(out))
        except FileExistsError as e:
            raise ConfigError(str(e)) from None
    if on_cluster():
        return  # a LoRA base's path is the cluster's, checked by the task where it is
    if state.base_model is not None:
        try:
            check_base_model(state.base_model, f"exporting {checkpoint}")
        except BaseModelMismatchError as e:
            raise ConfigError(str(e)) from None


def export_command(checkpoint: str, out: str, max_shard_mb: int = 5000, adapter_out: str | None = None) -> ExportResult:
    """``hymt export``: check, then export ``checkpoint`` (a checkpoint or run folder, path or URI) to ``out``;
    in this process, or in a Ray task when ``RAY_ADDRESS`` names a cluster (the module's docstring says why).

    On a cluster a local path may be one only the cluster's nodes hold (a shared filesystem): only a path
    that exists here, or a URI, is checked on this machine; the task checks the rest where it runs.
    """
    cluster = on_cluster()
    if not cluster or is_uri(checkpoint) or Path(checkpoint).expanduser().exists():
        checkpoint, state = resolve_checkpoint(checkpoint)
        check_export(checkpoint, state, out)
    checkpoint, out, adapter_out = _absolute(checkpoint), _absolute(out), _absolute(adapter_out)
    if cluster:
        where, peak = export_on_ray(checkpoint, out, max_shard_mb, adapter_out)
        return ExportResult(checkpoint, where, peak, on_ray=True)
    from raytrain_hymt.config.schema import deepspeed_accelerator_env
    from raytrain_hymt.console.quiet import no_bars
    from raytrain_hymt.train.export import export_stored

    for name, value in deepspeed_accelerator_env(use_gpu=False).items():  # the export needs no GPU
        os.environ.setdefault(name, value)
    with no_bars():  # DeepSpeed's shard-loading bar
        where, peak = export_stored(checkpoint, out, max_shard_mb * 10**6, adapter_out)
    return ExportResult(checkpoint, where, peak, on_ray=False)


def export_on_ray(checkpoint: str, out: str, max_shard_mb: int, adapter_out: str | None) -> tuple[str, float]:
    """Export in a Ray task of a fresh worker process (``max_calls=1``, so its lifetime peak memory is this
    export's) where the cluster has a CPU free; joins the cluster first. Returns ``(where, peak GiB)``."""
    import ray

    from raytrain_hymt.config.schema import Config, deepspeed_accelerator_env
    from raytrain_hymt.driver.session import init_ray
    from raytrain_hymt.train.export import export_stored

    init_ray(Config())
    task = ray.remote(num_cpus=1, max_calls=1, max_retries=0)(export_stored)
    env = {"env_vars": deepspeed_accelerator_env(use_gpu=False)}  # the export needs no GPU
    return ray.get(task.options(runtime_env=env).remote(checkpoint, out, max_shard_mb * 10**6, adapter_out))
