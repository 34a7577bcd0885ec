"""``hymt export`` of a stored checkpoint, run as a Ray task where the resources are (never in the CLI
process): the task streams the checkpoint into the model folder shard by shard (``export.export_checkpoint``)
and reports its own peak memory, which stays near ``2 × max shard + the libraries`` at any model size."""

from __future__ import annotations

import resource
import shutil
import tempfile


def _export(checkpoint: str, out: str, max_shard_bytes: int, adapter_out: str | None) -> tuple[str, float]:
    from raytrain_hymt.export import export_checkpoint
    from raytrain_hymt.storage import is_uri

    local, staged = checkpoint, None
    if is_uri(checkpoint):  # DeepSpeed reads local files: this node takes its own copy
        import pyarrow.fs

        fs, path = pyarrow.fs.FileSystem.from_uri(checkpoint)
        staged = tempfile.mkdtemp(prefix="hymt-export-ckpt-")
        pyarrow.fs.copy_files(path, staged, source_filesystem=fs, destination_filesystem=pyarrow.fs.LocalFileSystem())
        local = staged
    try:
        where = export_checkpoint(local, out, max_shard_bytes, adapter_out)
    finally:
        if staged:
            shutil.rmtree(staged, ignore_errors=True)
    # A fresh worker process (max_calls=1), so its lifetime peak is this export's.
    return where, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def export_stored_checkpoint(checkpoint: str, out: str, max_shard_mb: int = 5000,
                             adapter_out: str | None = None) -> tuple[str, float]:
    """Export ``checkpoint`` (a folder or URI) to ``out`` in a Ray task; returns ``(where, peak GiB)``.

    Joins the cluster in ``RAY_ADDRESS`` or starts a local Ray. Paths are resolved here, so a relative
    path means the same folder in the task.
    """
    import os

    import ray

    from raytrain_hymt.config import Config
    from raytrain_hymt.storage import is_uri
    from raytrain_hymt.session import init_ray

    def absolute(p: str | None) -> str | None:
        return p if p is None or is_uri(p) else os.path.abspath(os.path.expanduser(p))

    init_ray(Config())
    task = ray.remote(num_cpus=1, max_calls=1, max_retries=0)(_export)
    env = {"env_vars": {"DS_ACCELERATOR": "cpu"}}  # the export needs no GPU; DeepSpeed must not look for one
    return ray.get(task.options(runtime_env=env).remote(absolute(checkpoint), absolute(out), max_shard_mb * 10**6,
                                                        absolute(adapter_out)))
