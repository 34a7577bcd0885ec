"""The one batched translation function: the model card's prompts through the chat template, then
``generate``. Evaluation's Ray Data replicas, ``hymt translate`` and BLEU during training all call it, so
a sentence gets the same translation from each of them (same prompts, padding, stop tokens, decoding).

Worker layer: it needs a loaded model and tokenizer and starts nothing (no Ray).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import torch

#: The Hunyuan-MT model card's suggested sampling; written into the exported generation_config.json.
GENERATION_DEFAULTS = {"do_sample": True, "top_k": 20, "top_p": 0.6, "repetition_penalty": 1.05, "temperature": 0.7}

log = logging.getLogger("raytrain_hymt")

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
                  synced_gpus: bool = False, static: bool | None = None) -> list[str]:
        """Translations of one batch, stripped, in order. ``synced_gpus``: ZeRO-3, where every rank must
        take part in every forward until the last rank is done. ``static``: see :meth:`new_tokens`."""
        enc = self.encode(sources, src_langs, tgt_langs)
        if self.sample:
            torch.manual_seed(self.seed)  # the same input gives the same sample
        texts = self.tokenizer.batch_decode(self.new_tokens(enc, synced_gpus, static), skip_special_tokens=True)
        return [t.strip() for t in texts]

    def encode(self, sources: Sequence[str], src_langs: Sequence[str], tgt_langs: Sequence[str]):
        """The batch's prompts (model card's, through the chat template), padded on the left so that every
        row continues from its last prompt token, on the model's device."""
        from raytrain_hymt.data.prompts import build_prompt
        from raytrain_hymt.data.tokenize import render_prompts

        prompts = [build_prompt(str(s), str(a), str(b)) for s, a, b in zip(sources, src_langs, tgt_langs)]
        side, self.tokenizer.padding_side = self.tokenizer.padding_side, "left"
        try:  # restored: training saves its tokenizer with every checkpoint
            return self.tokenizer(render_prompts(self.tokenizer, prompts), add_special_tokens=False, padding=True,
                                  return_tensors="pt").to(self.device)
        finally:
            self.tokenizer.padding_side = side

    @torch.no_grad()
    def new_tokens(self, enc, synced_gpus: bool = False, static: bool | None = None) -> torch.Tensor:
        """The generated token ids of an :meth:`encode` batch (``[rows, steps]``, pad after a row's end).

        ``static`` (default: on GPU, greedy, not ``synced_gpus``) decodes greedily with a static KV cache
        and, on GPU, one decoding step replayed as a CUDA graph (:class:`StaticGreedy`); otherwise, and
        whenever the graph cannot be captured, transformers' ``generate``. Both stop once every row has
        emitted its end-of-answer token."""
        if static is None:
            static = self.device.type == "cuda" and not synced_gpus and not self.sample
        if static and self.sample:
            raise ValueError("static decoding is greedy: it cannot sample (sample=True)")
        was_training = self.model.training
        self.model.eval()
        try:
            if static:
                config = self.model.generation_config
                out = static_greedy(self.model, enc, config.max_new_tokens, config.eos_token_id, config.pad_token_id)
                if out is not None:
                    return out
            return self.model.generate(**enc, synced_gpus=synced_gpus)[:, enc["input_ids"].shape[1]:]
        finally:
            self.model.train(was_training)


#: Decoding steps between two checks on GPU whether every row has ended (each check waits for the GPU; on
#: CPU, where nothing runs ahead, every step checks).
STOP_CHECK_EVERY = 8
#: Whether the GPU decoding step is compiled (``torch.compile``, which fuses its chains of small kernels)
#: before it is captured. Off: on one H200 at 8 B with adapters it made the step 11.6 ms instead of 19.7,
#: but the first capture took 67–81 s, every new batch shape compiles again, and its fused kernels round
#: differently, so translations are no longer ``generate``'s (21 of 64 rows agreed up to the first near
#: tie; README "One H200"). ``jobs/bench_generation.py`` measures it.
COMPILE_STEP = False
#: A static cache's length is rounded up to this, so that nearby prompt lengths share one graph.
CACHE_ROUND = 128
#: The attribute of a model under which its decoder (graph, cache) is kept across batches and calls.
DECODER_ATTR = "_hymt_static_greedy"


def static_greedy(model, enc, max_new_tokens: int, stop_ids: Sequence[int], pad_id: int) -> torch.Tensor | None:
    """Greedy new tokens of ``enc`` with the model's :class:`StaticGreedy` decoder, built (and on GPU its
    graph captured) once per model and rebuilt only for a larger batch or longer prompts; ``None`` when
    the decoding step cannot be captured as a CUDA graph on this model (logged once; callers fall back
    to ``generate``)."""
    rows, length = enc["input_ids"].shape
    decoder = model.__dict__.get(DECODER_ATTR)  # __dict__: a peft wrapper would look into its base model
    if decoder is False:
        return None
    if decoder is None or not decoder.fits(rows, length + max_new_tokens, stop_ids, pad_id):
        rows_cap = max(rows, decoder.rows if decoder else 0)
        length_cap = -(-max(length + max_new_tokens, decoder.cache_len if decoder else 0) // CACHE_ROUND) * CACHE_ROUND
        model.__dict__.pop(DECODER_ATTR, None)
        del decoder  # its cache and graph pool go before the larger ones are allocated
        try:
            decoder = StaticGreedy(model, rows_cap, length_cap, stop_ids, pad_id)
        except RuntimeError as e:  # e.g. a model whose forward synchronises with the host (not capturable)
            log.warning("decoding falls back to generate(): the decoding step could not be captured as a CUDA "
                        "graph (%s: %s)", type(e).__name__, e)
            model.__dict__[DECODER_ATTR] = False
            return None
        model.__dict__[DECODER_ATTR] = decoder
    return decoder.run(enc, max_new_tokens)


def attn_implementation(model) -> str:
    """The attention implementation ``model`` runs with now (``attn_implementation=`` at load, or the last
    ``set_attn_implementation``).

    transformers 5.24.0 has no public getter: ``config._attn_implementation`` is what its own attention
    layers read at every forward (``test_generation.py`` checks that it still reports the setter's value).
    """
    return model.config._attn_implementation


class StaticGreedy:
    """Greedy decoding of up to ``rows`` rows with a static KV cache of ``cache_len`` positions.

    One decoding step (the token of each row at its own position, attention over the cache through a
    boolean mask that grows by one slot per step, argmax, rows that ended emit pad) works on fixed
    buffers, so on GPU it is captured once as a CUDA graph and then replayed with no host work; on CPU it
    runs as is. Rows are left-padded like ``generate``'s and get ``generate``'s position ids, and the
    prompt is a plain forward into the same cache. A smaller batch is padded with copies of its first
    row. Attention runs through SDPA while decoding (a model trained with flex attention included).
    The graph reads the parameters where they were at capture: :meth:`fits` rebuilds when any moved.
    """

    def __init__(self, model, rows: int, cache_len: int, stop_ids: Sequence[int], pad_id: int):
        import inspect

        from transformers import StaticCache

        self.model, self.rows, self.cache_len = model, rows, cache_len
        self.stop_ids, self.pad_id = list(stop_ids), pad_id
        self.pointers = self._pointers()
        device = next(model.parameters()).device
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # transformers >= 5.2x names the cache argument ``cache`` (``past_key_values`` is deprecated there).
        self.cache_arg = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
        self.stop = torch.tensor(self.stop_ids, device=device)
        self.token = torch.full((rows, 1), pad_id, dtype=torch.long, device=device)
        self.position = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.keep = torch.ones((rows, 1, 1, cache_len), dtype=torch.bool, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        self.graph = None
        with self._sdpa():
            self._forward(self.token, torch.ones_like(self.token), self.position)  # allocates the cache
            self.slot.fill_(1)
            if device.type == "cuda":
                self.graph = self._capture()

    def _pointers(self) -> list[int]:
        return [p.data_ptr() for p in self.model.parameters()]

    def fits(self, rows: int, cache_len: int, stop_ids: Sequence[int], pad_id: int) -> bool:
        """Whether this decoder serves a batch of ``rows`` rows needing ``cache_len`` positions."""
        return (rows <= self.rows and cache_len <= self.cache_len and list(stop_ids) == self.stop_ids
                and pad_id == self.pad_id and self._pointers() == self.pointers)

    @contextlib.contextmanager
    def _sdpa(self):
        before = attn_implementation(self.model)
        during = "sdpa" if before not in ("sdpa", "eager") else before
        if during == before:
            yield
            return
        # set_attn_implementation is transformers' public switch (a peft wrapper hands it to its base model).
        self.model.set_attn_implementation(during)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)

    def _forward(self, ids, attention_mask, position_ids):
        return self.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                          logits_to_keep=1, **{self.cache_arg: self.cache}).logits[:, -1]

    def _step(self) -> None:
        self.keep.index_fill_(3, self.slot, True)
        logits = self._forward(self.token, self.keep, self.position)
        token = torch.where(self.finished, self.pad_id, logits.argmax(-1))
        self.finished |= torch.isin(token, self.stop)
        self.token.copy_(token[:, None])
        self.position.add_(1)
        self.slot.add_(1)

    def _capture(self):
        step = self._step
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture requires
            if COMPILE_STEP:
                try:  # the warm-up compiles it
                    step = torch.compile(self._step, dynamic=False)
                    step()
                except Exception as e:  # noqa: BLE001 - the eager step is as exact, only slower
                    log.warning("the decoding step is captured uncompiled: torch.compile failed (%s: %s)",
                                type(e).__name__, e)
                    step = self._step
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph

    def run(self, enc, max_new_tokens: int) -> torch.Tensor:
        """New tokens of the batch ``enc`` (``[rows, steps]``), at most ``max_new_tokens`` each."""
        ids, mask = enc["input_ids"], enc["attention_mask"]
        rows, length = ids.shape
        if rows < self.rows:
            ids = torch.cat([ids, ids[:1].expand(self.rows - rows, -1)])
            mask = torch.cat([mask, mask[:1].expand(self.rows - rows, -1)])
        self.cache.reset()
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate() numbers them
        with self._sdpa():
            first = self._forward(ids, mask, positions).argmax(-1)
        self.keep.zero_()
        self.keep[:, 0, 0, :length] = mask.bool()
        self.finished.copy_(torch.isin(first, self.stop))
        self.token.copy_(first[:, None])
        self.position.copy_(positions[:, -1:] + 1)
        self.slot.fill_(length)
        out = [self.token.clone()]
        every = STOP_CHECK_EVERY if self.graph is not None else 1
        with self._sdpa():
            for step in range(1, max_new_tokens):
                if step % every == 0 and bool(self.finished.all()):
                    break
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self._step()
                out.append(self.token.clone())
        return torch.cat(out, 1)[:rows]


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
