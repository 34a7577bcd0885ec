"""Checkpoints: every rank's DeepSpeed shard + the run state, atomic by markers; export to Hugging Face.

Layout of one checkpoint (Ray merges the folder each rank reports into one):
    state.json                 step, epoch, data position, world size, tag, tracking run id (rank 0)
    hf/                        model config + tokenizer, so export needs nothing but this folder (rank 0)
    <tag>/...                  DeepSpeed's files: model states, each rank's optimizer shard
    rng/rank<R>.pt             each rank's RNG states
    complete/rank<R>           written last by each rank: the sizes of every file that rank wrote

A checkpoint is usable only when every rank's marker is there and every file it lists has the size it
lists (``check_checkpoint``). Sizes, not just presence: Ray's upload copies a folder's files in no fixed
order, so in storage a marker can arrive before a shard that is still being written, and a copy that
was cut off leaves a short file behind.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
HF_DIR = "hf"
MARKER_DIR = "complete"
#: Name of a checkpoint folder in the run folder (``checkpoint_dir_name`` given to ``ray.train.report``).
CHECKPOINT_DIR_RE = re.compile(r"^checkpoint_step(\d{8})(?:-g(\d+))?$")
#: peft's adapter config, saved into ``hf/`` by LoRA runs: export merges the adapters with it.
LORA_CONFIG_FILE = "adapter_config.json"

# The model card's suggested sampling (FACTS.md); written into the exported generation_config.json.
GENERATION_DEFAULTS = {"do_sample": True, "top_k": 20, "top_p": 0.6, "repetition_penalty": 1.05, "temperature": 0.7}


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
    """Times the run fell back to a checkpoint older than Ray's latest; part of the folder name, so a
    re-saved step never lands in the folder of a rejected checkpoint Ray still tracks (and deletes)."""
    data_fingerprint: dict | None = None
    """What the run trains on (``data.fingerprint``): sources, sizes, hashes, settings; checked on resume."""


class ResumeMismatchError(ValueError):
    """A run resumed with a batch shape other than the one it was checkpointed with."""


def check_same_shape(state: RunState, world_size: int, global_rows: int, zero_stage: int) -> None:
    """Refuse to resume with another worker count, global batch or ZeRO stage: the data position (global
    batches consumed) and the optimizer shards only mean something for the shape they were saved with."""
    saved = (state.world_size, state.global_rows or global_rows, state.zero_stage)
    if saved != (world_size, global_rows, zero_stage):
        raise ResumeMismatchError(
            f"this run was checkpointed with {state.world_size} workers, {state.global_rows} rows per step and "
            f"ZeRO-{state.zero_stage}; now {world_size} workers, {global_rows} rows per step, ZeRO-{zero_stage}. "
            "Resume with the original scaling.num_workers, optim.micro_batch_size, optim.grad_accum and "
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


def _file_sizes(folder: Path) -> dict[str, int]:
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def save_rank_checkpoint(engine, state: RunState, rank: int, tokenizer=None) -> str:
    """Write this rank's part of a checkpoint into a fresh temp folder and return it."""
    folder = tempfile.mkdtemp(prefix=f"hymt-ckpt-r{rank}-")
    engine.save_checkpoint(folder, tag=state.tag)
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
        if hasattr(engine.module, "peft_config"):  # LoRA: export merges the adapters (export_hf)
            engine.module.peft_config["default"].save_pretrained(hf)
        if tokenizer is not None:
            tokenizer.save_pretrained(hf)
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
    except (FileNotFoundError, OSError) as e:
        raise IncompleteCheckpointError(f"{path}: cannot list the checkpoint ({e})") from None
    sizes = {i.path[len(path) + 1:]: i.size for i in infos if i.type == pyarrow.fs.FileType.File}
    if STATE_FILE not in sizes:
        raise IncompleteCheckpointError(f"{path}: no {STATE_FILE} (rank 0 did not finish writing)")
    with fs.open_input_stream(f"{path}/{STATE_FILE}") as f:
        state = RunState(**json.loads(f.read()))
    missing = [r for r in range(state.world_size) if f"{MARKER_DIR}/rank{r}" not in sizes]
    if missing:
        raise IncompleteCheckpointError(f"{path}: ranks {missing} did not finish writing their part (no marker)")
    for rank in range(state.world_size):
        with fs.open_input_stream(f"{path}/{MARKER_DIR}/rank{rank}") as f:
            listed = json.loads(f.read())["files"]
        for name, size in listed.items():
            if name not in sizes:
                raise IncompleteCheckpointError(f"{path}: {name} of rank {rank} is missing")
            if sizes[name] != size:
                raise IncompleteCheckpointError(
                    f"{path}: {name} of rank {rank} has {sizes[name]} bytes, {size} were written (cut off)")
    return state


def read_state(folder: str | os.PathLike) -> RunState:
    """The run state of a local checkpoint folder, after checking it is whole (``check_checkpoint``)."""
    return check_checkpoint(*_local(folder))


def older_checkpoints(fs, path: str) -> list[str]:
    """Checkpoint folders beside ``path`` in its run folder with a smaller step, newest first.

    Ray hands a restarted worker group only its latest checkpoint; these are the fallbacks when that one
    turns out to be cut off.
    """
    import pyarrow.fs

    parent, name = path.rstrip("/").rsplit("/", 1)
    mine = _dir_order(name)
    found = []
    for info in fs.get_file_info(pyarrow.fs.FileSelector(parent)):
        order = _dir_order(info.base_name)
        if order and info.type == pyarrow.fs.FileType.Directory and (mine is None or order < mine):
            found.append((order, info.path))
    return [p for _, p in sorted(found, reverse=True)]


def restore_rank(engine, folder: str, rank: int) -> RunState:
    """Load this rank's DeepSpeed shard, scheduler and RNG states from a merged checkpoint folder.

    The caller checks the folder first (``check_checkpoint``); a file that is whole in size but not in
    content still makes DeepSpeed's ``torch.load`` raise here.
    """
    with open(Path(folder, STATE_FILE)) as f:
        state = RunState(**json.load(f))
    load_path, _ = engine.load_checkpoint(folder, tag=state.tag, load_lr_scheduler_states=True)
    if load_path is None:
        raise IncompleteCheckpointError(f"{folder}: DeepSpeed found no checkpoint under tag {state.tag}")
    rng = torch.load(Path(folder, "rng", f"rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state


def full_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Consolidated fp32 weights of a checkpoint, from any ZeRO stage."""
    state = read_state(folder)
    if state.zero_stage == 0:
        files = sorted(Path(folder, state.tag).glob("mp_rank_*_model_states.pt"))
        return torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32 prints its progress; keep it out of the user's console.
    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=state.tag)


def _check_export_target(out: Path) -> None:
    """Refuse to replace a folder that is not an exported model (export swaps the whole folder)."""
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        raise FileExistsError(f"{out} exists and is not a model folder; export to a new or empty folder")


def export_hf(folder: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a Hugging Face model folder (safetensors, config, tokenizer, generation config) from a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    read_state(folder)  # "not a (whole) checkpoint" before anything else, never a hub lookup of a typo
    out = Path(out_dir)
    _check_export_target(out)
    hf = Path(folder, HF_DIR)
    config = AutoConfig.from_pretrained(hf)
    weights = full_state_dict(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lora = (hf / LORA_CONFIG_FILE).exists()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig.from_pretrained(hf))
        # Frozen base weights come back in the training dtype: merge in fp32, round once at the end.
        weights = {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{folder}: checkpoint does not match its model config: missing {missing}, unexpected {unexpected}")
    if lora:
        # W + B·A·alpha/r into each target layer, adapters dropped: the export is a plain model.
        model = model.merge_and_unload()
    if tied:
        model.tie_weights()
    model = model.to(dtype)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if (hf / "tokenizer_config.json").exists():
        AutoTokenizer.from_pretrained(hf).save_pretrained(tmp)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        **GENERATION_DEFAULTS,
    ).save_pretrained(tmp)
    # Swap in whole: a reader never sees a half-written model folder.
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def export_checkpoint(folder: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """``hymt export``: export in the precision the run trained in (fp32 runs stay fp32, else bf16)."""
    import yaml

    run_config = Path(folder).parent / "config.yaml"
    precision = yaml.safe_load(run_config.read_text())["deepspeed"]["precision"] if run_config.exists() else "bf16"
    return export_hf(folder, out_dir, dtype=torch.float32 if precision == "fp32" else torch.bfloat16)
