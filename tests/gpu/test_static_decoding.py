"""The CUDA-graph greedy decoder (``generation.StaticGreedy``) against transformers' own greedy
``generate`` on a full-width Hunyuan-7B shape (2 layers, bf16, on the GPU): the same tokens for a batch
whose rows stop at different steps, after a rebuild for a larger batch and longer prompts, and through
the eager fallback when the step cannot be captured."""

from __future__ import annotations

import pytest

from gpu_models import skip_without_cuda

skip_without_cuda()

import torch  # noqa: E402

from gpu_models import model_folder  # noqa: E402

SOURCES = ["Hello.", "The cat sat on the mat and looked out of the window for a long time.", "I like tea.",
           "Where is the station?", "It is raining again today, so we will stay at home and read.", "Thank you!"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def generator():
    from raytrain_hymt.evaluation.generation import Generator
    from raytrain_hymt.train.model import load_generator

    g = load_generator(model_folder(), "bf16", MAX_NEW, use_gpu=True)
    # A random model hardly ever ends an answer: the end-of-answer token takes over the head's row of a
    # token that row 0 emits a few steps in, so rows end wherever they would have emitted it (some do not).
    stop = g.model.generation_config.eos_token_id[0]
    enc = g.encode(SOURCES, ["en"] * 6, ["zh"] * 6)
    first = g.new_tokens(enc, static=False)
    head = g.model.get_output_embeddings().weight
    with torch.no_grad():
        head[stop] = head[int(first[0, 3])] * 1.01
    g.model.__dict__.pop("_hymt_static_greedy", None)  # built before the change: the pointers are the same
    assert isinstance(g, Generator)
    return g


def rows(tokens: torch.Tensor, pad: int) -> list[list[int]]:
    """Each row's tokens up to its last non-pad token (the static decoder checks for the end every few
    steps, so it may return a few more pad columns than ``generate``)."""
    out = []
    for r in tokens.tolist():
        while r and r[-1] == pad:
            r.pop()
        out.append(r)
    return out


def both(g, sources):
    enc = g.encode(sources, ["en"] * len(sources), ["zh"] * len(sources))
    pad = g.tokenizer.pad_token_id
    return rows(g.new_tokens(enc, static=False), pad), rows(g.new_tokens(enc, static=True), pad)


@pytest.mark.timeout(300)
def test_cuda_graph_decoding_gives_generates_tokens_with_rows_that_stop_early(generator):
    from raytrain_hymt.evaluation.generation import DECODER_ATTR

    want, got = both(generator, SOURCES)
    assert got == want
    assert min(map(len, want)) < MAX_NEW  # some rows ended early ...
    assert len(want[0]) == 4 and max(map(len, want)) > 4  # ... at different steps
    decoder = generator.model.__dict__[DECODER_ATTR]
    assert decoder.graph is not None and decoder.rows == len(SOURCES)
    # A smaller batch is served by the same decoder and graph.
    want, got = both(generator, SOURCES[2:5])
    assert got == want and generator.model.__dict__[DECODER_ATTR] is decoder


@pytest.mark.timeout(300)
def test_a_larger_batch_and_longer_prompts_rebuild_the_decoder(generator):
    from raytrain_hymt.evaluation.generation import DECODER_ATTR

    before = generator.model.__dict__.get(DECODER_ATTR)
    longer = [s + " " + " ".join(["And then the long sentence goes on and on."] * 12) for s in SOURCES]
    want, got = both(generator, longer + SOURCES)
    assert got == want
    decoder = generator.model.__dict__[DECODER_ATTR]
    assert decoder is not before and decoder.rows == 12 and decoder.graph is not None
    assert before is None or decoder.cache_len > before.cache_len


@pytest.mark.timeout(300)
def test_a_step_that_cannot_be_captured_falls_back_to_generate(generator, caplog):
    from raytrain_hymt.evaluation.generation import DECODER_ATTR

    generator.model.__dict__.pop(DECODER_ATTR, None)

    def host_sync(module, args, output):  # a forward that reads a value on the host cannot be captured
        float(output.logits[0, -1, 0])

    hook = generator.model.register_forward_hook(host_sync)
    try:
        enc = generator.encode(SOURCES, ["en"] * 6, ["zh"] * 6)
        pad = generator.tokenizer.pad_token_id
        got = rows(generator.new_tokens(enc), pad)  # the default on GPU: static, falling back
        assert generator.model.__dict__[DECODER_ATTR] is False
        assert "falls back to generate()" in caplog.text
        assert got == rows(generator.new_tokens(enc, static=False), pad)
    finally:
        hook.remove()
        generator.model.__dict__.pop(DECODER_ATTR, None)
