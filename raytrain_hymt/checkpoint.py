"""Checkpoints: every rank's DeepSpeed shard + the run state, atomic by markers; export to Hugging Face.

Layout of one checkpoint (Ray merges the folder each rank reports into one):
    state.json                 step, epoch, data position, world size, tag, tracking run id (rank 0)
    hf/                        model config + tokenizer, so export needs nothing but this folder (rank 0)
    <tag>/...                  DeepSpeed's files: model states, each rank's optimizer shard
    rng/rank<R>.pt             each rank's RNG states
    complete/rank<R>           written last by each rank: the checkpoint is whole only with all of them
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
HF_DIR = "hf"

# The model card's suggested sampling (FACTS.md); written into the exported generation_config.json.
GENERATION_DEFAULTS = {"do_sample": True, "top_k": 20, "top_p": 0.6, "repetition_penalty": 1.05, "temperature": 0.7}


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint that was cut off mid-write (a rank's marker is missing)."""


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


def step_tag(step: int) -> str:
    """DeepSpeed tag of the checkpoint at ``step`` (never ``latest``: DeepSpeed writes a file of that name)."""
    return f"step{step:08d}"


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
        if tokenizer is not None:
            tokenizer.save_pretrained(hf)
    marker = Path(folder, "complete")
    marker.mkdir()
    # Last write: a checkpoint whose markers are not all there was cut off and is never resumed from.
    (marker / f"rank{rank}").write_text("ok")
    return folder


def read_state(folder: str | os.PathLike) -> RunState:
    """The run state of a checkpoint folder, after checking every rank's marker is there."""
    path = Path(folder, STATE_FILE)
    if not path.exists():
        raise IncompleteCheckpointError(f"{folder}: no {STATE_FILE} (rank 0 did not finish writing)")
    state = RunState(**json.loads(path.read_text()))
    missing = [r for r in range(state.world_size) if not Path(folder, "complete", f"rank{r}").exists()]
    if missing:
        raise IncompleteCheckpointError(f"{folder}: ranks {missing} did not finish writing their shard")
    return state


def restore_rank(engine, folder: str, rank: int) -> RunState:
    """Load this rank's DeepSpeed shard, scheduler and RNG states from a merged checkpoint folder."""
    state = read_state(folder)
    load_path, _ = engine.load_checkpoint(folder, tag=state.tag, load_lr_scheduler_states=True)
    if load_path is None:
        raise IncompleteCheckpointError(f"{folder}: DeepSpeed found no checkpoint under tag {state.tag}")
    rng_file = Path(folder, "rng", f"rank{rank}.pt")
    if rng_file.exists():
        rng = torch.load(rng_file, weights_only=False)
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


def export_hf(folder: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a Hugging Face model folder (safetensors, config, tokenizer, generation config) from a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    hf = Path(folder, HF_DIR)
    config = AutoConfig.from_pretrained(hf)
    weights = full_state_dict(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{folder}: checkpoint does not match its model config: missing {missing}, unexpected {unexpected}")
    if tied:
        model.tie_weights()
    model = model.to(dtype)
    out = Path(out_dir)
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
