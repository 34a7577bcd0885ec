"""Checkpoints: every rank's DeepSpeed shard + the run state, atomic by markers (export: ``train.export``).

Layout of one checkpoint (Ray merges the folder each rank reports into one):
    state.json                 step, epoch, data position, world size, tag, tracking run id (rank 0)
    hf/                        model config + tokenizer, so export needs nothing but this folder (rank 0)
    <tag>/...                  DeepSpeed's files: model states, each rank's optimizer shard (LoRA: the
                               adapters only; the frozen base is rebuilt from ``state.base_model``)
    rng/rank<R>.pt             each rank's RNG states
    complete/rank<R>           written last by each rank: the sizes of every file that rank wrote

A checkpoint is usable only when every rank's marker is there and every file it lists has the size it
lists (``check_checkpoint``). Sizes, not just presence: Ray's upload copies a folder's files in no fixed
order, so in storage a marker can arrive before a shard that is still being written, and a copy that
was cut off leaves a short file behind.

Resume on another worker count: DeepSpeed's universal checkpoints.

DeepSpeed 0.19.8 refuses to load ZeRO optimizer partitions saved at another data-parallel world size
("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
supported"). Its universal checkpoint format gets around that: ``ds_to_universal`` turns the saved
partitions into one file per parameter and state (``zero/<name>/fp32.pt``, ``exp_avg.pt``,
``exp_avg_sq.pt`` and the optimizer step), whole, and an engine whose config has ``checkpoint.load_universal``
cuts its own partitions out of them. DeepSpeed takes that switch at ``deepspeed.initialize`` only, so the
worker reads the state of the checkpoint it will resume from before it builds its engine. The checkpoint
in storage stays the ordinary one: the conversion runs only when a run resumes on another count, once per
node (local rank 0, into a node-local temp folder that is removed after the load), and every other resume
loads the shards as before.

ZeRO-0 needs none of this: its optimizer state is not partitioned, so any worker count loads it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger("raytrain_hymt")

STATE_FILE = "state.json"
HF_DIR = "hf"
MARKER_DIR = "complete"
#: Name of a checkpoint folder in the run folder (``checkpoint_dir_name`` given to ``ray.train.report``).
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint_step(\d{8})(?:-g(\d+))?$")
#: peft's adapter config, saved into ``hf/`` by LoRA runs: export merges the adapters with it.
LORA_CONFIG_FILE = "adapter_config.json"



class IncompleteCheckpointError(RuntimeError):
    """A checkpoint that was cut off mid-write (a marker missing, a file missing or short)."""


@dataclass
class RunState:
    """What travels with a checkpoint besides the DeepSpeed shards."""

    step: int
    epoch: int
    batch_in_epoch: int
    world_size: int
    tag: str
    zero_stage: int
    tracking_run_id: str | None = None
    skipped_steps: int = 0
    global_rows: int = 0
    """Rows per optimizer step (workers × accumulation × micro-batch); the data position counts these."""
    generation: int = 0
    """Part of the folder name once the run fell back to a checkpoint older than Ray's latest: 1 + the
    highest generation in storage, so a re-saved step never lands in the folder of a rejected checkpoint
    Ray still tracks (and deletes)."""
    precision: str = "bf16"
    """Training precision; ``hymt export`` writes fp32 runs in fp32, the others in bf16."""
    base_model: dict | None = None
    """LoRA runs: the identity of the frozen base (``base_identity``). Their checkpoints hold only the
    adapters, so resume and export rebuild the base from it and refuse another one."""
    data_fingerprint: dict | None = None
    """What the run trains on (``data.fingerprint``): sources, sizes, hashes, settings; checked on resume."""
    submission: str | None = None
    """The id of the submission (``hymt train`` or a job) that saved it: restoring a checkpoint of the same
    submission is one of Ray Train's restarts, not a resume."""
    submission_start: int = 0
    """The step the saving submission started from (0: it started the run); its summary counts from there."""


class ResumeMismatchError(ValueError):
    """A run resumed with a batch shape other than the one it was checkpointed with."""


def check_same_shape(state: RunState, global_rows: int, zero_stage: int) -> None:
    """Refuse to resume with another global batch or ZeRO stage: the data position counts global batches,
    and the optimizer states are converted across worker counts (``reshard``), not across stages. Another
    worker count is fine when the global batch stays (``optim.global_batch_rows``)."""
    saved = (state.global_rows or global_rows, state.zero_stage)
    if saved != (global_rows, zero_stage):
        raise ResumeMismatchError(
            f"this run was checkpointed with {state.global_rows} rows per step ({state.world_size} workers) and "
            f"ZeRO-{state.zero_stage}; now {global_rows} rows per step, ZeRO-{zero_stage}. Set "
            f"optim.global_batch_rows={state.global_rows} to resume on any worker count (or the original "
            "scaling.num_workers, optim.micro_batch_size and optim.grad_accum) and the original "
            "deepspeed.zero_stage, or start a new run (another --name)"
        )


def step_tag(step: int) -> str:
    """DeepSpeed tag of the checkpoint at ``step`` (never ``latest``: DeepSpeed writes a file of that name)."""
    return f"step{step:08d}"


def checkpoint_dir_name(step: int, generation: int = 0) -> str:
    """Folder of the checkpoint at ``step`` inside the run folder: ``checkpoint_step00000010``, with
    ``-g<N>`` after the run fell back to an older checkpoint N times."""
    return f"checkpoint_{step_tag(step)}" + (f"-g{generation}" if generation else "")


def _dir_order(name: str) -> tuple[int, int] | None:
    m = CHECKPOINT_DIR_RE.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def list_checkpoints(fs, run_path: str) -> list[str]:
    """The names of the checkpoint folders in the run folder ``run_path`` (a path of ``fs``), newest first:
    by step, then by generation (a fallback's folder of the same step is newer). [] when there is none or
    the run folder does not exist. The one listing that resuming, falling back and Ctrl-C all use."""
    import pyarrow.fs

    infos = fs.get_file_info(pyarrow.fs.FileSelector(run_path.rstrip("/"), allow_not_found=True))
    found = [(_dir_order(i.base_name), i.base_name) for i in infos if i.type == pyarrow.fs.FileType.Directory]
    return [name for order, name in sorted((f for f in found if f[0]), reverse=True)]


def _file_sizes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def save_rank_checkpoint(engine, state: RunState, rank: int, tokenizer=None) -> str:
    """Write this rank's part of a checkpoint into a fresh temp folder and return it.

    LoRA runs (``state.base_model`` set) leave the frozen base out: the checkpoint is the adapters with
    their optimizer states, megabytes instead of the whole model twice over.
    """
    folder = tempfile.mkdtemp(prefix=f"hymt-ckpt-r{rank}-")
    engine.save_checkpoint(folder, tag=state.tag, exclude_frozen_parameters=state.base_model is not None)
    rng = Path(folder, "rng")
    rng.mkdir()
    torch.save(
        {"python": random.getstate(), "torch": torch.get_rng_state(),
         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        rng / f"rank{rank}.pt",
    )
    if rank == 0:
        Path(folder, STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        hf = Path(folder, HF_DIR)
        engine.module.config.save_pretrained(hf)
        if hasattr(engine.module, "peft_config"):  # LoRA: export merges the adapters onto the base
            engine.module.peft_config["default"].save_pretrained(hf)
        if tokenizer is not None:
            tokenizer.save_pretrained(hf)
    from raytrain_hymt.train import faults

    faults.disk_full(state.step, rank, checkpoint_dir_name(state.step, state.generation),
                     ([STATE_FILE] if rank == 0 else []) + [f"{MARKER_DIR}/rank{rank}"])
    # The folder holds only this rank's files: they are what its marker vouches for.
    manifest = _file_sizes(Path(folder))
    marker = Path(folder, MARKER_DIR)
    marker.mkdir()
    # Last write: a checkpoint whose markers are not all there was cut off and is never resumed from.
    (marker / f"rank{rank}").write_text(json.dumps({"files": manifest}, indent=0))
    return folder


def _local(folder: str | os.PathLike):
    """``(filesystem, path)`` of a local folder, the form ``check_checkpoint`` takes."""
    import pyarrow.fs

    return pyarrow.fs.LocalFileSystem(), str(Path(folder).resolve())


def check_checkpoint(fs, path: str) -> RunState:
    """The run state of the checkpoint at ``path`` on pyarrow filesystem ``fs``, after checking it is whole.

    Raises ``IncompleteCheckpointError`` naming what is wrong: no state, a rank's marker missing, a file
    its marker lists missing or of another size. Reads only the listing, ``state.json`` and the markers
    (a few small files), so it is cheap on object stores too.
    """
    import pyarrow.fs

    path = path.rstrip("/")
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: no such folder (a checkpoint is a run's checkpoint_step* folder)") from None
    except OSError as e:
        raise IncompleteCheckpointError(f"{path}: cannot list the checkpoint ({e})") from None
    sizes = {i.path[len(path) + 1:]: i.size for i in infos if i.type == pyarrow.fs.FileType.File}
    if STATE_FILE not in sizes and not any(name.startswith(f"{MARKER_DIR}/") for name in sizes):
        raise IncompleteCheckpointError(
            f"{path} is not a checkpoint: it has no {STATE_FILE} and no {MARKER_DIR}/ markers (a checkpoint is "
            "a run's checkpoint_step* folder, e.g. <run.storage_root>/<name>/checkpoint_step00000020)")
    if STATE_FILE not in sizes:
        raise IncompleteCheckpointError(f"{path}: no {STATE_FILE} (rank 0 did not finish writing)")
    state = _read_whole(fs, path, STATE_FILE, lambda d: RunState(**d))
    missing = [r for r in range(state.world_size) if f"{MARKER_DIR}/rank{r}" not in sizes]
    if missing:
        raise IncompleteCheckpointError(f"{path}: ranks {missing} did not finish writing their part (no marker)")
    for rank in range(state.world_size):
        listed = _read_whole(fs, path, f"{MARKER_DIR}/rank{rank}", lambda d: dict(d["files"]))
        for name, size in listed.items():
            if name not in sizes:
                raise IncompleteCheckpointError(f"{path}: {name} of rank {rank} is missing")
            if sizes[name] != size:
                raise IncompleteCheckpointError(
                    f"{path}: {name} of rank {rank} has {sizes[name]} bytes, {size} were written (cut off)")
    return state


def _read_whole(fs, path: str, name: str, parse):
    """``parse`` of the JSON in ``<path>/<name>``; a file that is empty, cut off or not what was written
    (a full disk leaves such files) makes the checkpoint incomplete, never another error."""
    with fs.open_input_stream(f"{path}/{name}") as f:
        data = f.read()
    if not data.strip():
        raise IncompleteCheckpointError(f"{path}: {name} is empty (cut off while it was written)")
    try:
        return parse(json.loads(data))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise IncompleteCheckpointError(
            f"{path}: {name} is cut off or damaged ({len(data)} bytes; {type(e).__name__}: {e})") from None


def newest_whole_checkpoint(fs, run_path: str, warn: bool = True) -> tuple[str, RunState] | None:
    """``(name, run state)`` of the newest whole checkpoint (``check_checkpoint``) in the run folder
    ``run_path`` of pyarrow filesystem ``fs``, or None when there is none. Each newer one that was cut off
    is skipped with one warning naming it (``warn``)."""
    for name in list_checkpoints(fs, run_path):
        try:
            return name, check_checkpoint(fs, f"{run_path.rstrip('/')}/{name}")
        except IncompleteCheckpointError as e:
            if warn:
                log.warning("not resuming from %s", e)
    return None


def unreadable_file(fs, path: str, error: BaseException) -> str:
    """What to say when a checkpoint whole in size (``check_checkpoint``) fails to load: the first
    ``.pt`` file under ``path`` on pyarrow filesystem ``fs`` that is not a readable PyTorch archive (its
    size is right, so its content is damaged), else ``error`` itself."""
    import zipfile

    import pyarrow.fs

    infos = fs.get_file_info(pyarrow.fs.FileSelector(path.rstrip("/"), recursive=True))
    for info in sorted((i for i in infos if i.path.endswith(".pt")), key=lambda i: i.path):
        try:
            with fs.open_input_file(info.path) as f, zipfile.ZipFile(f):
                continue
        except (zipfile.BadZipFile, OSError):
            return (f"{info.path} is damaged: it has the size its rank wrote but is not a readable PyTorch "
                    f"file ({type(error).__name__}: {error})")
    return f"{type(error).__name__}: {error}"


def read_state(folder: str | os.PathLike) -> RunState:
    """The run state of a local checkpoint folder, after checking it is whole (``check_checkpoint``)."""
    return check_checkpoint(*_local(folder))


def older_checkpoints(fs, path: str) -> list[str]:
    """Checkpoint folders beside ``path`` in its run folder with a smaller step, newest first.

    Ray hands a restarted worker group only its latest checkpoint; these are the fallbacks when that one
    turns out to be cut off.
    """
    parent, name = path.rstrip("/").rsplit("/", 1)
    mine = _dir_order(name)
    return [f"{parent}/{n}" for n in list_checkpoints(fs, parent) if mine is None or _dir_order(n) < mine]


def saved_files(folder: str, world: int) -> list[str]:
    """The files (relative paths) that ranks 0..``world``-1 listed in their markers of the checkpoint in
    local ``folder``: exactly this checkpoint's. An attempt with more workers that was cut off while saving
    the same step may have left its extra ranks' shards in the folder; a same-count load never opens them,
    the universal conversion would take them as partitions (it counts the ZeRO files it finds)."""
    files = []
    for rank in range(world):
        files += json.loads(Path(folder, MARKER_DIR, f"rank{rank}").read_text())["files"]
    return files


def needs_universal(state: RunState, world: int) -> bool:
    """Whether a checkpoint of ``state`` loads on ``world`` workers only through DeepSpeed's universal form:
    ZeRO-1/2/3 partitions saved at another worker count (``load_resharded``)."""
    return world != state.world_size and state.zero_stage > 0


def restore_rank(engine, folder: str, rank: int, world: int | None = None, local_rank: int = 0, device=None,
                 where: str | None = None) -> RunState:
    """Load this rank's DeepSpeed shard, scheduler and RNG states from a merged checkpoint folder.

    The caller checks the folder first (``check_checkpoint``); a file that is whole in size but not in
    content still makes DeepSpeed's ``torch.load`` raise here. A checkpoint saved by another worker count
    than ``world`` (every rank passes it, and ``local_rank``/``device`` for the node's one conversion) is
    loaded through DeepSpeed's universal form (``reshard``); ``where`` names it in storage.
    """
    with open(Path(folder, STATE_FILE)) as f:
        state = RunState(**json.load(f))
    # A LoRA checkpoint has no frozen weights: those stay as loaded from the base (checked: base_model).
    strict = state.base_model is None
    universal = world is not None and needs_universal(state, world)
    if engine.load_universal_checkpoint() != universal:
        # DeepSpeed takes the switch from the config given to initialize (Worker.build decides it).
        raise RuntimeError(f"{where or folder}: saved on {state.world_size} workers, loaded on {world}: the engine "
                           f"must be initialised with checkpoint.load_universal={universal}")
    if universal:
        load_path = load_resharded(engine, folder, state.tag, where or folder, local_rank, device, strict,
                                   files=saved_files(folder, state.world_size))
    else:
        load_path, _ = engine.load_checkpoint(folder, tag=state.tag, load_lr_scheduler_states=True,
                                              load_module_strict=strict)
    if load_path is None:
        raise IncompleteCheckpointError(f"{folder}: DeepSpeed found no checkpoint under tag {state.tag}")
    # A rank the saving run did not have takes the states of rank (its rank mod the saved count): the
    # model has no dropout in the tests that compare trajectories, and a real run only needs fresh draws.
    rng = torch.load(Path(folder, "rng", f"rank{rank % state.world_size}.pt"), weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def load_weights_only(engine, folder: str, where: str | None = None) -> RunState:
    """Load only the model weights of the whole checkpoint in local ``folder`` into ``engine`` (a new run
    that starts from another run's weights, ``model.init_from``); its run state.

    DeepSpeed's module-only load (its documented warm start) reads the weights a checkpoint's module holds
    (under ZeRO-3 the fp32 partitions, merged) and refreshes the optimizer's fp32 copies from them; the
    optimizer state, learning-rate schedule and step count stay those of a new engine, and any worker
    count loads them. A LoRA checkpoint holds only the adapters: they load onto the base the engine has.
    """
    state = read_state(folder)
    load_path, _ = engine.load_checkpoint(folder, tag=state.tag, load_module_strict=state.base_model is None,
                                          load_optimizer_states=False, load_lr_scheduler_states=False,
                                          load_module_only=True)
    if load_path is None:
        raise IncompleteCheckpointError(f"{where or folder}: DeepSpeed found no checkpoint under tag {state.tag}")
    return state


def next_generation(fs, run_path: str) -> int:
    """1 + the highest checkpoint generation in the run folder ``run_path``: a fallback then never
    recomputes the name of a folder that still exists."""
    return 1 + max((_dir_order(n)[1] for n in list_checkpoints(fs, run_path)), default=0)


def base_identity(name_or_path: str, seed: int) -> dict:
    """What makes a LoRA run's frozen base this base: its config and a hash of its weight index.

    A folder: sha256 of ``config.json`` and of the safetensors index (or of each shard's header, which
    lists every tensor's name, shape and offsets). The tiny model: its seed. A hub id: its name only
    (resolving a revision needs the network).
    """
    from raytrain_hymt.tokenizer import TINY_MODEL

    if name_or_path == TINY_MODEL:
        return {"name_or_path": TINY_MODEL, "seed": seed}
    folder = Path(name_or_path)
    if not folder.is_dir():
        return {"name_or_path": name_or_path}
    digest = hashlib.sha256()
    index = folder / "model.safetensors.index.json"
    if index.exists():
        digest.update(index.read_bytes())
    else:
        for file in sorted(folder.glob("*.safetensors")):
            with open(file, "rb") as f:
                head = f.read(8)
                digest.update(head + f.read(int.from_bytes(head, "little")))
    config = (folder / "config.json").read_bytes() if (folder / "config.json").exists() else b""
    return {"name_or_path": str(folder.resolve()), "config_sha256": hashlib.sha256(config).hexdigest(),
            "weights_sha256": digest.hexdigest()}


class BaseModelMismatchError(ValueError):
    """A LoRA checkpoint used with a base model other than the one it was trained on."""


def check_base_model(saved: dict | None, doing: str, name_or_path: str | None = None, seed: int | None = None) -> None:
    """Refuse ``doing`` (resume, export) with another base than the LoRA checkpoint's ``saved`` one.

    ``name_or_path``/``seed``: the base about to be used (default: the saved path, as it is now).
    """
    if saved is None:
        raise BaseModelMismatchError(f"{doing}: the checkpoint records no base model (saved by an older version)")
    now = base_identity(name_or_path or saved["name_or_path"], saved.get("seed", 0) if seed is None else seed)
    if now != saved:
        changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
        raise BaseModelMismatchError(
            f"{doing}: the LoRA adapters were trained on base {saved['name_or_path']!r}, but the base is now "
            f"{now['name_or_path']!r} and differs in {', '.join(changed)}. LoRA checkpoints hold only the "
            "adapters: point model.name_or_path at the original base, or start a new run (another --name)"
        )




def universal_dir(checkpoint: str) -> Path:
    """The node-local folder of the universal form of ``checkpoint`` (one per checkpoint path)."""
    import hashlib

    key = hashlib.sha256(checkpoint.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir(), "hymt-universal", key)


def convert_to_universal(folder: str, tag: str, out: Path, workers: int | None = None) -> float:
    """Write the universal form of DeepSpeed checkpoint ``<folder>/<tag>`` to ``<out>/<tag>``; seconds taken.

    ``workers``: processes that extract the ZeRO fragments (default: half the CPUs, at least 1). Runs
    DeepSpeed's documented command line (``python -m deepspeed.checkpoint.ds_to_universal``) in a child
    process; a failed conversion raises ``RuntimeError`` with the end of its output.
    """
    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    n = workers or max(1, (os.cpu_count() or 2) // 2)
    # --inject_missing_state: DeepSpeed records the universal-checkpoint info only for Megatron-style
    # models; a Hugging Face model has no tensor or pipeline parallelism, so the version stamp is all it needs.
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
               "--input_folder", str(Path(folder, tag)), "--output_folder", str(out / tag),
               "--num_extract_workers", str(n), "--num_merge_workers", str(max(1, n // 2)), "--inject_missing_state"]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    log.debug("%s", done.stdout)
    if done.returncode != 0:
        tail = "\n".join(done.stdout.strip().splitlines()[-20:])
        raise RuntimeError(f"{folder}/{tag}: DeepSpeed's ds_to_universal exited with status {done.returncode}:\n{tail}")
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
    """Load checkpoint ``folder`` (saved at another worker count) into ``engine`` through its universal form;
    ``engine`` was initialised with ``checkpoint.load_universal`` (``engine.build_ds_config``).

    Local rank 0 of each node converts, the others wait (an all-reduce that also tells every rank whether
    any conversion failed); then every rank loads its new partition. ``files``: the checkpoint's own files
    (``checkpoint.saved_files``), the only ones converted. Returns DeepSpeed's load path.
    """
    from raytrain_hymt.train.distributed import all_reduce_sum

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
    try:
        load_path, _ = engine.load_checkpoint(str(out), tag=tag, load_lr_scheduler_states=True,
                                              load_module_strict=load_module_strict)
    finally:
        # On every path, so the ranks' all-reduces stay paired: every rank has read the folder (or failed)
        # before it goes.
        all_reduce_sum([0.0], device)
        if local_rank == 0:
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(out.name + "-in"), ignore_errors=True)
    return load_path
