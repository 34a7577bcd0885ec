"""The one batched translation function: the model card's prompts through the chat template, then
``generate``. Evaluation's Ray Data replicas, ``hymt translate`` and BLEU during training all call it, so
a sentence gets the same translation from each of them (same prompts, padding, stop tokens, decoding).

Worker layer: it needs a loaded model and tokenizer and starts nothing (no Ray).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

import torch

#: Model precision names of the config (``deepspeed.precision``) → torch dtypes.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Generator:
    """A model and its tokenizer set up for translation: greedy by default, or the model card's sampling.

    The model's own ``generation_config`` is replaced: greedy must not depend on whatever sampling defaults
    a model folder's generation_config.json carries (Hunyuan-MT's top_k/top_p/temperature), and replacing
    it (rather than passing one per call) keeps transformers from warning about the unused flags.
    """

    def __init__(self, model, tokenizer, max_new_tokens: int, sample: bool = False, seed: int = 0):
        from transformers import GenerationConfig

        from raytrain_hymt.export import GENERATION_DEFAULTS
        from raytrain_hymt.data.tokenize import answer_suffix

        self.model, self.tokenizer, self.seed = model, tokenizer, seed
        self.device = next(model.parameters()).device
        # The chat template's end-of-answer token (Hunyuan: <|eos|>) ends each translation.
        stop = tokenizer.convert_tokens_to_ids(answer_suffix(tokenizer).strip())
        stop_ids = sorted({stop, tokenizer.eos_token_id} - {None, tokenizer.unk_token_id})
        decoding = dict(GENERATION_DEFAULTS) if sample else {"do_sample": False}
        model.generation_config = GenerationConfig(
            num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
            pad_token_id=tokenizer.pad_token_id, **decoding)
        self.sample = sample

    @torch.no_grad()
    def translate(self, sources: Sequence[str], src_langs: Sequence[str], tgt_langs: Sequence[str],
                  synced_gpus: bool = False) -> list[str]:
        """Translations of one batch, stripped, in order. Prompts are padded on the left (every row
        continues from its last prompt token). ``synced_gpus``: ZeRO-3, where every rank must take part
        in every forward until the last rank is done."""
        from raytrain_hymt.data.prompts import build_prompt
        from raytrain_hymt.data.tokenize import render_prompts

        prompts = [build_prompt(str(s), str(a), str(b)) for s, a, b in zip(sources, src_langs, tgt_langs)]
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:  # restored: training saves its tokenizer with every checkpoint
            enc = self.tokenizer(render_prompts(self.tokenizer, prompts), add_special_tokens=False, padding=True,
                                 return_tensors="pt").to(self.device)
        finally:
            self.tokenizer.padding_side = side
        if self.sample:
            torch.manual_seed(self.seed)  # the same input gives the same sample
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(**enc, synced_gpus=synced_gpus)
        finally:
            self.model.train(was_training)
        texts = self.tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return [t.strip() for t in texts]


#: Prefix of the local copies replicas make of a model given as a URI (``<tempdir>/<prefix><token>-*``).
COPY_PREFIX = "hymt-eval-model-"


def local_model_path(model: str, token: str = "") -> str:
    """``model`` itself, or for a URI (``s3://``, ``gs://``, ``file://``) a local copy of that folder: a
    replica may run on any node, and only a shared path, a hub id or a URI reaches every node. ``token``
    names the evaluation the copy belongs to (its driver removes what its replicas leave on its node)."""
    from raytrain_hymt.storage import is_uri

    if not is_uri(model):
        return model
    import tempfile

    import pyarrow.fs

    fs, path = pyarrow.fs.FileSystem.from_uri(model)
    local = tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{token}-")
    pyarrow.fs.copy_files(path, local, source_filesystem=fs, destination_filesystem=pyarrow.fs.LocalFileSystem())
    return local


def load_generator(model: str, precision: str, max_new_tokens: int, use_gpu: bool,
                   trust_remote_code: bool = False, sample: bool = False, copy_token: str = "") -> Generator:
    """A :class:`Generator` for ``model`` (a folder, hub id, URI or ``tiny``) on GPU 0 or the CPU."""
    import transformers

    from raytrain_hymt.model import load_model
    from raytrain_hymt.tokenizer import load_tokenizer

    transformers.utils.logging.disable_progress_bar()  # one bar per replica would clutter the job's log
    device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
    local = local_model_path(model, copy_token)
    tokenizer = load_tokenizer(local, trust_remote_code)
    loaded = load_model(local, tokenizer, dtype=DTYPES[precision], trust_remote_code=trust_remote_code,
                        device=device).to(device).eval()
    if local != model:
        # Loaded (a memory-mapped file stays readable after its unlink): free the disk (16 GB at 7B).
        shutil.rmtree(local, ignore_errors=True)
    return Generator(loaded, tokenizer, max_new_tokens, sample=sample)


def batches_longest_first(sources: Sequence[str], batch_size: int) -> list[list[int]]:
    """Indices of ``sources`` in batches of ``batch_size``, longest first, so similar lengths share a
    batch (little padding) and the slowest batches start early. Evaluation's Ray Data pool forms the same
    batches (the same sort, consecutive rows), so every caller pads a sentence alike."""
    order = sorted(range(len(sources)), key=lambda i: -len(sources[i]))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def translate_all(generator: Generator, sources: Sequence[str], src_langs: Sequence[str],
                  tgt_langs: Sequence[str], batch_size: int, synced_gpus: bool = False,
                  report_errors: bool = False) -> tuple[list[str], list[str]]:
    """Translations of every source in order, in-process, in :func:`batches_longest_first` batches, and
    per sentence its error ("" when none). Without ``report_errors`` an error is raised instead (training
    ranks must fail alike; a retry one by one would leave ZeRO-3's other ranks waiting)."""
    texts, errors = [""] * len(sources), [""] * len(sources)
    for batch in batches_longest_first(sources, batch_size):
        args = ([sources[i] for i in batch], [src_langs[i] for i in batch], [tgt_langs[i] for i in batch])
        if report_errors:
            got, errs = translate_or_report(generator, *args)
        else:
            got, errs = generator.translate(*args, synced_gpus=synced_gpus), [""] * len(batch)
        for i, text, err in zip(batch, got, errs):
            texts[i], errors[i] = text, err
    return texts, errors


def translate_or_report(generator: Generator, sources: Sequence[str], src_langs: Sequence[str],
                        tgt_langs: Sequence[str]) -> tuple[list[str], list[str]]:
    """One batch's translations and, per sentence, the error that stopped it ("" when none).

    When the batch fails (out of memory, a sentence the tokenizer rejects), each sentence is tried on its
    own so one bad sentence loses no other; the errors name the exception.
    """
    try:
        return generator.translate(sources, src_langs, tgt_langs), [""] * len(sources)
    except Exception:  # noqa: BLE001 - retried one by one below; a sentence's own error is kept
        pass
    texts, errors = [], []
    for s, a, b in zip(sources, src_langs, tgt_langs):
        try:
            texts.append(generator.translate([s], [a], [b])[0])
            errors.append("")
        except Exception as e:  # noqa: BLE001 - reported with the sentence's line by the caller
            texts.append("")
            errors.append(f"{type(e).__name__}: {e}")
    return texts, errors
