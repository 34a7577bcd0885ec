"""Resume on another worker count: DeepSpeed's universal checkpoints.

DeepSpeed 0.19.8 refuses to load ZeRO optimizer partitions saved at another data-parallel world size
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported"). Its universal checkpoint format gets around that: ``ds_to_universal`` turns the saved
partitions into one file per parameter and state (``zero/<name>/fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt`` and the optimizer step), whole, and an engine whose config has ``checkpoint.load_universal``
cuts its own partitions out of them. The checkpoint in storage stays the ordinary one: the conversion
runs only when a run resumes on another count, once per node (local rank 0, into a node-local temp folder
that is removed after the load), and every other resume loads the shards as before.

ZeRO-0 needs none of this: its optimizer state is not partitioned, so any worker count loads it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from argparse import Namespace
from pathlib import Path

log = logging.getLogger("raytrain_hymt")


def universal_dir(checkpoint: str) -> Path:
    """The node-local folder of the universal form of ``checkpoint`` (one per checkpoint path)."""
    import hashlib

    key = hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir(), "hymt-universal", key)


def convert_to_universal(folder: str, tag: str, out: Path, workers: int | None = None) -> float:
    """Write the universal form of DeepSpeed checkpoint ``<folder>/<tag>`` to ``<out>/<tag>``; seconds taken.

    ``workers``: processes that extract the ZeRO fragments (default: half the CPUs, at least 1).
    """
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    n = workers or max(1, (os.cpu_count() or 2) // 2)
    # inject_missing_state: DeepSpeed records the universal-checkpoint info only for Megatron-style
    # models; a Hugging Face model has no tensor or pipeline parallelism, so the version stamp is all it needs.
    ds_to_universal(Namespace(input_folder=str(Path(folder, tag)), output_folder=str(out / tag),
                              num_extract_workers=n, num_merge_workers=max(1, n // 2), keep_temp_folder=False,
                              strict=True, inject_missing_state=True))
    return time.perf_counter() - started


def linked_view(folder: str, files: list[str], view: Path) -> Path:
    """A fresh folder ``view`` of symbolic links to ``files`` (paths relative to ``folder``), nothing else."""
    shutil.rmtree(view, ignore_errors=True)
    for name in files:
        link = view / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(folder, name).resolve())
    return view


def load_resharded(engine, folder: str, tag: str, checkpoint: str, local_rank: int, device,
                   load_module_strict: bool, files: list[str]):
    """Load checkpoint ``folder`` (saved at another worker count) into ``engine`` through its universal form.

    Local rank 0 of each node converts, the others wait (an all-reduce that also tells every rank whether
    any conversion failed); then every rank loads its new partition. ``files``: the checkpoint's own files
    (``checkpoint.saved_files``), the only ones converted. Returns DeepSpeed's load path.
    """
    from raytrain_hymt.ranks import all_reduce_sum

    out = universal_dir(checkpoint)
    failed = None
    if local_rank == 0:
        try:
            source = linked_view(folder, files, out.with_name(out.name + "-in"))
            seconds = convert_to_universal(str(source), tag, out)
            log.info("converted %s to a universal checkpoint for the new worker count in %.1f s", checkpoint, seconds)
        except Exception as e:  # noqa: BLE001 - shared with every rank below, then raised
            failed = e
    (failures,) = all_reduce_sum([1.0 if failed else 0.0], device)
    if failed is not None:
        raise failed
    if failures:
        raise RuntimeError(f"{checkpoint}: the conversion to a universal checkpoint failed on {int(failures)} node(s)")
    # DeepSpeed reads the switch from its config at load time (engine.load_universal_checkpoint()).
    engine._config.load_universal_checkpoint = True
    try:
        load_path, _ = engine.load_checkpoint(str(out), tag=tag, load_lr_scheduler_states=True,
                                              load_module_strict=load_module_strict)
    finally:
        engine._config.load_universal_checkpoint = False
        # On every path, so the ranks' all-reduces stay paired: every rank has read the folder (or failed)
        # before it goes.
        all_reduce_sum([0.0], device)
        if local_rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(out.name + "-in"), ignore_errors=True)
    return load_path
