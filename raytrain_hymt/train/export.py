"""Export a Hugging Face model folder: sharded safetensors with an index, config, tokenizer, generation config.

Two producers feed one writer, and neither ever holds more than one shard of weights in host memory:

* ``export_from_engine``: at the end of a run, on every training worker. Rank 0 writes; under ZeRO-3 each
  parameter is gathered on its own (``GatheredParameters``) and dropped once it is in a shard. The driver
  never loads the weights: it only learns where the folder is.
* ``export_checkpoint``: ``hymt export`` of a stored checkpoint, tensor by tensor through DeepSpeed's lazy
  ``zero_to_fp32`` (``lazy_mode=True``). ``export_stored`` (a checkpoint in bucket storage copied to local
  disk first) runs in the command's own process, or in a Ray task on a cluster (``driver.export`` decides);
  either reports its peak memory, which stays near ``2 × max shard + the libraries`` at any model size.

LoRA runs save only the adapters (``checkpoint.save_rank_checkpoint``); both producers merge them onto the
frozen base named by ``model.name_or_path`` (``W + alpha/r · B·A`` in fp32, rounded once), so the export is
a plain model. ``write_adapter`` writes the adapter-only PEFT folder that vLLM and TGI serve on a base.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from raytrain_hymt.evaluation.generation import GENERATION_DEFAULTS
from raytrain_hymt.storage import is_uri

INDEX_FILE = "model.safetensors.index.json"
_PEFT_PREFIX = "base_model.model."


def hf_name(peft_name: str) -> str:
    """The plain model's parameter name of a peft-wrapped one (``...q_proj.base_layer.weight`` →
    ``...q_proj.weight``); other names pass through."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


@dataclass
class LoraAdapters:
    """Full fp32 adapter weights by target module (``model.layers.0.self_attn.q_proj``) and their scale."""

    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    scaling: float

    @classmethod
    def from_named(cls, named: Iterable[tuple[str, torch.Tensor]], scaling: float) -> LoraAdapters:
        """Collect ``...lora_A.default.weight`` / ``...lora_B.default.weight`` tensors by module."""
        a, b = {}, {}
        for name, tensor in named:
            plain = hf_name(name)
            for key, into in ((".lora_A.default.weight", a), (".lora_B.default.weight", b)):
                if plain.endswith(key):
                    into[plain[: -len(key)]] = tensor.detach().float().cpu()
        if a.keys() != b.keys():
            raise ValueError(f"LoRA adapters are incomplete: A for {sorted(a)}, B for {sorted(b)}")
        return cls(a, b, scaling)

    def merge(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The base tensors of ``stream`` with ``scaling · B·A`` added to each adapted weight (in fp32)."""
        used = set()
        for name, tensor in stream:
            module = name[: -len(".weight")] if name.endswith(".weight") else None
            if module in self.a:
                tensor = tensor.float() + self.scaling * (self.b[module] @ self.a[module])
                used.add(module)
            yield name, tensor
        if used != self.a.keys():
            raise ValueError(f"LoRA adapters for {sorted(self.a.keys() - used)} match no weight of the base model")


class _Destination:
    """Where the folder goes: a local folder (written beside it, then swapped in whole) or a URI (each file
    uploaded as soon as it is complete, the index last, so one shard at a time is on local disk)."""

    def __init__(self, out: str):
        self.out = out
        if is_uri(out):
            import pyarrow.fs

            self.fs, self.path = pyarrow.fs.FileSystem.from_uri(out)
            self.staging = Path(tempfile.mkdtemp(prefix="hymt-export-"))
        else:
            self.fs = None
            target = Path(out)
            check_export_target(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        self.written: list[str] = []

    def put(self, name: str) -> None:
        """``staging/name`` is complete: upload it now (URI) or keep it for the swap (local)."""
        self.written.append(name)
        if self.fs is not None:
            import pyarrow.fs

            self.fs.create_dir(self.path, recursive=True)
            pyarrow.fs.copy_files(str(self.staging / name), f"{self.path}/{name}",
                                  source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=self.fs)
            (self.staging / name).unlink()

    def commit(self) -> str:
        """Publish the folder; returns its path or URI."""
        if self.fs is None:
            # mkdtemp and safetensors create owner-only modes; an export is as readable as any new folder.
            umask = os.umask(0)
            os.umask(umask)
            self.staging.chmod(0o777 & ~umask)
            for p in self.staging.iterdir():
                p.chmod(0o666 & ~umask)
            _swap_in(self.staging, Path(self.out))
            return str(Path(self.out))
        import pyarrow.fs

        keep = set(self.written)
        for info in self.fs.get_file_info(pyarrow.fs.FileSelector(self.path, recursive=True)):
            # A file of an earlier export that this one did not write again (an old shard layout).
            if info.type == pyarrow.fs.FileType.File and info.path[len(self.path) + 1:] not in keep:
                self.fs.delete_file(info.path)
        shutil.rmtree(self.staging, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def check_export_target(out: Path) -> None:
    """Refuse to replace a folder that is not an exported model (export swaps the whole folder)."""
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        raise FileExistsError(f"{out} exists and is not a model folder; export to a new or empty folder")


def _swap_in(new: Path, out: Path) -> None:
    """Make ``new`` the folder ``out`` with no moment in which ``out`` is missing or half-written.

    An existing ``out`` is exchanged with ``new`` in one ``renameat2(RENAME_EXCHANGE)`` (Linux), then the
    old contents are removed; where the call is missing, a plain rename onto a fresh name is the fallback.
    """
    if not out.exists():
        new.rename(out)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    at_fdcwd, rename_exchange = -100, 2
    if renameat2 is not None and renameat2(at_fdcwd, os.fsencode(new), at_fdcwd, os.fsencode(out), rename_exchange) == 0:
        shutil.rmtree(new)  # now holds the previous export
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old)


class ShardWriter:
    """Safetensors shards of at most ``max_bytes`` each (a larger single tensor gets a shard of its own),
    written as tensors arrive, plus ``model.safetensors.index.json``."""

    def __init__(self, dest: _Destination, max_bytes: int, dtype: torch.dtype):
        self.dest, self.max_bytes, self.dtype = dest, max_bytes, dtype
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().to(device="cpu", dtype=self.dtype if tensor.is_floating_point() else tensor.dtype)
        size = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        file = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        save_file(self.pending, str(self.dest.staging / file), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, file))
        self.pending, self.pending_bytes = {}, 0
        self.dest.put(file)

    def close(self) -> None:
        if self.pending:
            self._flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.dest.staging / INDEX_FILE).write_text(json.dumps(index, indent=1))


def _write_metadata(dest: _Destination, config, tokenizer, dtype: torch.dtype) -> None:
    """config.json (the plain architecture, the export dtype), the tokenizer and generation_config.json."""
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = config.__class__.from_dict(config.to_dict())  # a copy: the live model keeps its own
    config.dtype = dtype
    # Serving engines pick the model class from ``architectures`` (a model built from_config has none).
    config.architectures = config.architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.save_pretrained(dest.staging)
    if tokenizer is not None:
        tokenizer.save_pretrained(dest.staging)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        **GENERATION_DEFAULTS,
    ).save_pretrained(dest.staging)


def write_model(tensors: Iterable[tuple[str, torch.Tensor]], config, tokenizer, out: str, dtype: torch.dtype,
                max_shard_bytes: int) -> str:
    """Write the model folder ``out`` (a path or URI) from ``(name, tensor)`` pairs in the plain model's
    names; returns where it is. The tensors are consumed one at a time."""
    dest = _Destination(out)
    try:
        writer = ShardWriter(dest, max_shard_bytes, dtype)
        for name, tensor in tensors:
            writer.add(name, tensor)
        writer.close()
        _write_metadata(dest, config, tokenizer, dtype)
        for p in sorted(dest.staging.iterdir(), key=lambda p: p.name == INDEX_FILE):  # the index last
            if p.name not in dest.written:
                dest.put(p.name)
        return dest.commit()
    except BaseException:
        dest.abort()
        raise


def write_adapter(adapters: LoraAdapters, lora_config, out: str) -> str:
    """An adapter-only PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) that serving
    engines (vLLM, TGI) load on top of the base model."""
    from safetensors.torch import save_file

    dest = _Destination(out)
    try:
        tensors = {}
        for module in adapters.a:
            tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = adapters.a[module].contiguous()
            tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = adapters.b[module].contiguous()
        save_file(tensors, str(dest.staging / "adapter_model.safetensors"), metadata={"format": "pt"})
        lora_config.save_pretrained(dest.staging)
        for p in dest.staging.iterdir():
            dest.put(p.name)
        return dest.commit()
    except BaseException:
        dest.abort()
        raise


# --- from a live engine, at the end of training ---------------------------------------------------------


def _gathered(engine, params: list[tuple[str, torch.nn.Parameter]], master: bool,
              keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each parameter's full value, one at a time, on every rank (each call below is collective); a CPU
    copy where ``keep`` (the writing rank), else None.

    ``master``: the optimizer's fp32 copy (LoRA adapters, merged in fp32); else the module's own value,
    which after every step equals the fp32 master rounded to the training dtype.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    stage3 = engine.zero_optimization_stage() == 3
    for name, p in params:
        value = safe_get_full_fp32_param(p) if master and p.requires_grad else None
        if value is None and stage3:
            with deepspeed.zero.GatheredParameters([p]):
                value = p.data.detach().to("cpu", copy=True) if keep else None
        elif value is None:
            value = p.data.detach()
        yield name, value.to("cpu") if keep else None


def export_from_engine(engine, tokenizer, out: str, dtype: torch.dtype, max_shard_bytes: int, rank: int,
                       adapter_out: str | None = None) -> str | None:
    """Write the trained model of ``engine`` to ``out`` (path or URI), and for LoRA the adapters alone to
    ``adapter_out``. Every rank must call it (ZeRO gathers are collective); rank 0 writes and returns where
    the model folder is, the others return None."""
    module = engine.module
    peft_config = getattr(module, "peft_config", {}).get("default")
    named = list(module.named_parameters())
    base_config = module.get_base_model().config if peft_config is not None else module.config
    adapters = None
    if peft_config is not None:  # the adapters first (small, every rank keeps them), then the frozen base
        adapters = LoraAdapters.from_named(
            _gathered(engine, [(n, p) for n, p in named if p.requires_grad], master=True, keep=True),
            peft_config.lora_alpha / peft_config.r,
        )
        named = [(n, p) for n, p in named if not p.requires_grad]
    gathered = _gathered(engine, named, master=False, keep=rank == 0)
    if rank != 0:
        for _ in gathered:  # take part in every gather
            pass
        return None
    stream = ((hf_name(n), t) for n, t in gathered)
    if adapters is not None:
        stream = adapters.merge(stream)
    if adapters is not None and adapter_out:
        write_adapter(adapters, peft_config, adapter_out)
    return write_model(stream, base_config, tokenizer, out, dtype, max_shard_bytes)


# --- from a stored checkpoint (``hymt export``) ----------------------------------------------------------


def _checkpoint_tensors(folder: Path, tag: str, zero_stage: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's fp32 weights, one tensor at a time."""
    if zero_stage == 0:
        files = sorted(Path(folder, tag).glob("mp_rank_*_model_states.pt"))
        states = torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)["module"]
        yield from states.items()
        return
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
        lazy = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag, lazy_mode=True)
    for name in list(lazy):
        yield name, lazy.pop(name).contiguous()


def base_tensors(name_or_path: str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of a base model one tensor at a time: a folder's (or cached hub id's) safetensors, or
    the tiny model rebuilt from its seed."""
    from raytrain_hymt.tokenizer import TINY_MODEL, load_tokenizer
    from raytrain_hymt.train.model import load_model

    if name_or_path == TINY_MODEL:
        model = load_model(TINY_MODEL, load_tokenizer(TINY_MODEL), seed=seed)
        yield from ((n, p.detach()) for n, p in model.named_parameters())
        return
    from safetensors import safe_open

    folder = Path(name_or_path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"]))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights to merge the LoRA adapters onto")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, f.get_tensor(key)


def export_checkpoint(folder: str | os.PathLike, out: str, max_shard_bytes: int, adapter_out: str | None = None) -> str:
    """Export a stored checkpoint (any ZeRO stage, LoRA or not) to the model folder ``out``, streaming;
    for LoRA also the adapters alone to ``adapter_out`` when given."""
    from transformers import AutoConfig, AutoTokenizer

    from raytrain_hymt.train.checkpoint import HF_DIR, LORA_CONFIG_FILE, check_base_model, read_state

    folder = Path(folder)
    state = read_state(folder)  # "not a (whole) checkpoint" before anything else
    hf = folder / HF_DIR
    config = AutoConfig.from_pretrained(hf)
    dtype = torch.float32 if state.precision == "fp32" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(hf) if (hf / "tokenizer_config.json").exists() else None
    stream = _checkpoint_tensors(folder, state.tag, state.zero_stage)
    if (hf / LORA_CONFIG_FILE).exists():
        from peft import LoraConfig

        lora = LoraConfig.from_pretrained(hf)
        check_base_model(state.base_model, f"exporting {folder}")
        adapters = LoraAdapters.from_named(stream, lora.lora_alpha / lora.r)
        if adapter_out:
            write_adapter(adapters, lora, adapter_out)
        stream = adapters.merge(base_tensors(state.base_model["name_or_path"], state.base_model.get("seed", 0)))
    else:
        stream = ((hf_name(n), t) for n, t in stream)
    if config.tie_word_embeddings:
        stream = ((n, t) for n, t in stream if n != "lm_head.weight")
    return write_model(stream, config, tokenizer, out, dtype, max_shard_bytes)


def export_stored(checkpoint: str, out: str, max_shard_bytes: int, adapter_out: str | None) -> tuple[str, float]:
    """Export ``checkpoint`` (a local folder, or a URI copied to this machine's disk first: DeepSpeed reads
    local files) to ``out``; returns ``(where, peak GiB of this process)``. Paths are absolute: in a Ray task
    a relative one would mean the worker's folder."""
    local, staged = checkpoint, None
    if is_uri(checkpoint):
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
    return where, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
