"""The one generation function (raytrain_hymt.evaluation.generation): translations pinned to what evaluation's
replicas produced before it was extracted (CPU, fp32, the tiny random-init model, seed 0: exact)."""

from __future__ import annotations

import numpy as np
import pytest

from raytrain_hymt.evaluation.generation import batches_longest_first, translate_all, translate_or_report
from raytrain_hymt.train.model import load_generator

from conftest import FLORES_DEVTEST

SOURCES = ["Hello.", "The cat sat on the mat and looked out of the window for a long time.", "我喜欢猫。",
           "Guten Morgen, wie geht es dir?"]
SRC = ["en", "en", "zh", "de"]
TGT = ["zh", "de", "en", "ja"]
# evaluate.Translator's output for these four rows in one batch (max_new_tokens 12), recorded at commit
# ba359d5, before generation.py existed. A random model's tokens are nonsense, but exactly reproducible.
PINNED = ["sk�看到好 carount花学j�看到 o", "�散步神��散步�Get�散步ead神", "knew|妹ount好Umeric�我的朋友脱 knew糕",
          "st散步�散步�散步�散步�散步�散步"]


@pytest.fixture(scope="module")
def tiny_generator():
    return load_generator("tiny", "fp32", 12, use_gpu=False)


def test_translations_are_the_ones_evaluation_produced_before_the_extraction(tiny_generator):
    from raytrain_hymt.driver.evaluate import Translator

    assert tiny_generator.translate(SOURCES, SRC, TGT) == PINNED
    # The Ray Data actor of hymt evaluate is a thin shell over the same function.
    actor = Translator("tiny", "fp32", 12, use_gpu=False)
    batch = {"id": np.arange(4), "src": np.array(SOURCES, dtype=object), "src_lang": np.array(SRC, dtype=object),
             "tgt_lang": np.array(TGT, dtype=object)}
    out = actor(batch)
    assert list(out["hyp"]) == PINNED and list(out["error"]) == [""] * 4


def test_batches_are_longest_first_and_translations_come_back_in_order(tiny_generator):
    assert batches_longest_first(SOURCES, 3) == [[1, 3, 0], [2]]  # by characters
    # One batch of all four: the same padding as above, so the same texts, in input order.
    assert translate_all(tiny_generator, SOURCES, SRC, TGT, batch_size=4) == (PINNED, [""] * 4)


def test_a_failing_sentence_loses_no_other(tiny_generator):
    # "xx" is no language: build_prompt fails for that sentence only, once the batch is retried one by one.
    texts, errors = translate_or_report(tiny_generator, SOURCES[:2], ["en", "en"], ["zh", "xx"])
    assert texts[0] == tiny_generator.translate(SOURCES[:1], ["en"], ["zh"])[0] and texts[1] == ""
    assert errors[0] == "" and errors[1].startswith("UnsupportedLanguageError: ") and "xx" in errors[1]


def test_sampling_follows_the_model_card_and_is_seeded():
    from raytrain_hymt.evaluation.generation import GENERATION_DEFAULTS

    g = load_generator("tiny", "fp32", 12, use_gpu=False, sample=True)
    config = g.model.generation_config
    assert {k: getattr(config, k) for k in GENERATION_DEFAULTS} == GENERATION_DEFAULTS
    first = g.translate(SOURCES, SRC, TGT)
    assert g.translate(SOURCES, SRC, TGT) == first and first != PINNED


def test_static_cache_decoding_gives_the_same_translations_and_keeps_its_decoder(tiny_generator):
    # The GPU path (static KV cache; there one step is a CUDA graph) run eagerly on CPU: exactly generate()'s
    # output, also for a smaller batch (padded to the decoder's rows) served by the same decoder.
    from raytrain_hymt.evaluation.generation import DECODER_ATTR

    assert tiny_generator.translate(SOURCES, SRC, TGT, static=True) == PINNED
    decoder = tiny_generator.model.__dict__[DECODER_ATTR]
    assert (decoder.rows, decoder.cache_len) == (4, 128)
    assert tiny_generator.translate(SOURCES[1:3], SRC[1:3], TGT[1:3], static=True) == PINNED[1:3]
    assert tiny_generator.model.__dict__[DECODER_ATTR] is decoder
    # A batch of more rows than the decoder holds gets a new, larger one.
    assert tiny_generator.translate(SOURCES * 2, SRC * 2, TGT * 2, static=True) == PINNED * 2
    assert tiny_generator.model.__dict__[DECODER_ATTR].rows == 8


def test_static_decoding_stops_where_generate_stops_on_a_trained_model(finished_run):
    # A trained tiny model ends its answers early: both paths stop at the step where the last row has
    # emitted its end-of-answer token, with the same tokens.
    from raytrain_hymt.driver.evaluate import load_test_set, plan_rows

    storage, summary = finished_run
    generator = load_generator(summary.model_dir, "fp32", 64, use_gpu=False)
    rows = plan_rows(load_test_set(FLORES_DEVTEST), ["en-zh", "zh-en"], 8)
    enc = generator.encode([r["src"] for r in rows], [r["src_lang"] for r in rows], [r["tgt_lang"] for r in rows])
    before = generator.new_tokens(enc, static=False)
    after = generator.new_tokens(enc, static=True)
    assert before.shape[1] < 64 and after.tolist() == before.tolist()


def test_decoding_switches_attention_to_sdpa_and_back_through_transformers_public_setter():
    """Static decoding runs through SDPA whatever the model trains with, then gives the model its own
    attention back (``set_attn_implementation``). Reading the current one relies on transformers 5.24.0's
    private ``config._attn_implementation`` (no public getter): this fails if that attribute stops
    reporting what ``attn_implementation=`` and the setter chose, or if the layers stop following it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from raytrain_hymt.evaluation.generation import attn_implementation
    from raytrain_hymt.tokenizer import load_tokenizer
    from raytrain_hymt.train.model import load_model

    calls = []

    def probe(*args, **kwargs):  # SDPA itself, counted: a stand-in for flex attention that runs on CPU
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("hymt_probe", probe)
    AttentionMaskInterface.register("hymt_probe", sdpa_mask)
    tok = load_tokenizer("tiny")
    assert attn_implementation(load_model("tiny", tok, attn_implementation="eager")) == "eager"
    g = load_generator("tiny", "fp32", 12, use_gpu=False)
    assert attn_implementation(g.model) == "sdpa"
    g.model.set_attn_implementation("hymt_probe")
    assert attn_implementation(g.model) == "hymt_probe"
    g.translate(SOURCES[:1], SRC[:1], TGT[:1], static=False)  # generate() keeps the model's attention
    assert calls
    calls.clear()
    assert g.translate(SOURCES, SRC, TGT, static=True) == PINNED
    assert not calls and attn_implementation(g.model) == "hymt_probe"
