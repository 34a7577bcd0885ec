"""Packing, the document-masked collate, and the proof that packed rows lose nothing.

The equivalence tests run the tiny random-init hunyuan_v1_dense model in fp32 and compare every example's
logits and summed loss inside packed (or padded) rows against the same example run alone: batch of 1, no
padding, no mask, default position ids, eager attention (the plainest path transformers has). One
reference for all implementations keeps flex_attention cheap on CPU: its unmasked path would compile
a new kernel for every example length.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytrain_hymt.data.packing import (
    IGNORE_INDEX,
    PAD_DOCUMENT_ID,
    as_single_rows,
    batch_to_device,
    collate,
    document_additive_mask,
    next_fit_bounds,
    pack_examples,
    token_loss_sum,
)
from raytrain_hymt.train.model import load_model
from raytrain_hymt.tokenizer import load_tokenizer

ATTN_IMPLEMENTATIONS = ["sdpa", "eager", "flex_attention"]
TOL = 1e-5
PACK_TOKENS = 120


def _objects(arrays) -> np.ndarray:
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = np.asarray(a)
    return out


def _batch(input_ids, labels, example_ids) -> dict[str, np.ndarray]:
    return {
        "input_ids": _objects(input_ids),
        "labels": _objects(labels),
        "example_id": np.asarray(example_ids, dtype=np.int64),
    }


# --------------------------------------------------------------------------------------------------
# (a) pack_examples / as_single_rows / collate: exact outputs on hand-made batches
# --------------------------------------------------------------------------------------------------


def test_next_fit_is_greedy_in_input_order():
    # First-fit would put the 2 into the first group; next-fit never looks back.
    # Groups [0], [1, 2], [3] and [0, 1], [2], [3]: row g is lengths[bounds[g]:bounds[g + 1]].
    assert next_fit_bounds([4, 4, 2, 3], 6).tolist() == [0, 1, 3, 4]
    assert next_fit_bounds([3, 3, 6, 1], 6).tolist() == [0, 2, 3, 4]
    assert next_fit_bounds([], 6).tolist() == [0]
    with pytest.raises(ValueError, match=r"item 1 has 7 tokens > max_tokens=6"):
        next_fit_bounds([1, 7], 6)


def test_pack_examples_exact_outputs():
    ids = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31], [40, 41, 42]]
    # The first label of example 2 is not -100 on purpose: packing masks it (nothing precedes it).
    labels = [[-100, -100, 12, 13], [-100, 21, 22, 23], [30, 31], [-100, -100, -100]]
    out = pack_examples(_batch(ids, labels, [7, 8, 9, 5]), max_tokens=6)

    assert set(out) == {"input_ids", "labels", "position_ids", "seq_lens", "example_ids", "num_target_tokens"}
    assert len(out["input_ids"]) == 3
    expect = {
        "input_ids": [[10, 11, 12, 13], [20, 21, 22, 23, 30, 31], [40, 41, 42]],
        "labels": [[-100, -100, 12, 13], [-100, 21, 22, 23, -100, 31], [-100, -100, -100]],
        "position_ids": [[0, 1, 2, 3], [0, 1, 2, 3, 0, 1], [0, 1, 2]],
        "seq_lens": [[4], [4, 2], [3]],
        "example_ids": [[7], [8, 9], [5]],
    }
    for col, rows in expect.items():
        assert out[col].dtype == object, col
        for got, want in zip(out[col], rows, strict=True):
            np.testing.assert_array_equal(got, want, err_msg=col)
    assert [out["seq_lens"][0].dtype, out["example_ids"][0].dtype] == [np.int32, np.int64]
    np.testing.assert_array_equal(out["num_target_tokens"], [2, 4, 0])


def test_pack_examples_accepts_stacked_equal_length_rows():
    # Ray Data hands a 2-D array when every row of a batch has the same length.
    batch = {
        "input_ids": np.array([[1, 2, 3], [4, 5, 6]]),
        "labels": np.array([[-100, 2, 3], [-100, -100, 6]]),
        "example_id": np.array([0, 1]),
    }
    out = pack_examples(batch, max_tokens=8)
    np.testing.assert_array_equal(out["input_ids"][0], [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(out["seq_lens"][0], [3, 3])
    np.testing.assert_array_equal(out["num_target_tokens"], [3])


def test_pack_examples_rejects_too_long_example():
    batch = _batch([[1, 2], list(range(9))], [[-100, 2], [-100] * 9], [3, 7])
    with pytest.raises(ValueError, match=r"example_id 7 has 9 tokens > max_tokens=6; tokenization must drop"):
        pack_examples(batch, max_tokens=6)


def test_as_single_rows_one_example_per_row():
    out = as_single_rows(_batch([[1, 2, 3], [4, 5]], [[1, 2, 3], [-100, 5]], [11, 12]))
    np.testing.assert_array_equal(out["labels"][0], [-100, 2, 3])
    np.testing.assert_array_equal(out["position_ids"][1], [0, 1])
    assert [list(s) for s in out["seq_lens"]] == [[3], [2]]
    assert [list(e) for e in out["example_ids"]] == [[11], [12]]
    np.testing.assert_array_equal(out["num_target_tokens"], [2, 1])


def test_rows_are_a_valid_ray_data_block():
    from ray.data.block import BlockAccessor

    out = pack_examples(_batch([[1, 2, 3], [4, 5], [6]], [[-100, 2, 3], [-100, 5], [-100]], [0, 1, 2]), 4)
    back = BlockAccessor.for_block(BlockAccessor.batch_to_block(out)).to_batch_format("numpy")
    for col in out:
        for got, want in zip(back[col], out[col], strict=True):
            np.testing.assert_array_equal(got, want, err_msg=col)


def test_collate_pads_and_masks_documents():
    rows = pack_examples(_batch([[5, 6, 7], [8, 9]], [[-100, 6, 7], [-100, 9]], [0, 1]), 8)
    c = collate(rows, pad_token_id=0, attn_implementation="eager", pad_to_multiple_of=8)
    assert c["input_ids"].dtype == torch.long and c["input_ids"].shape == (1, 8)
    assert c["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert c["labels"][0].tolist() == [-100, 6, 7, -100, 9, -100, -100, -100]
    assert c["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert c["document_ids"][0].tolist() == [0, 0, 0, 1, 1] + [PAD_DOCUMENT_ID] * 3
    assert c["num_target_tokens"].item() == 3 == int(rows["num_target_tokens"].sum())
    assert [e.tolist() for e in c["example_ids"]] == [[0, 1]]

    mask = c["attention_mask"]
    assert mask.shape == (1, 1, 8, 8) and mask.dtype == torch.float32
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],  # the second document does not see the first
        [0, 0, 0, 1, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 0, 0],  # padding sees only padding: no query row is fully masked
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1],
    ]
    assert mask.min().item() == torch.finfo(torch.float32).min

    assert collate(rows, pad_token_id=0, attn_implementation="sdpa", pad_to=16)["input_ids"].shape == (1, 16)
    with pytest.raises(ValueError, match="pad_to=4"):
        collate(rows, pad_token_id=0, attn_implementation="sdpa", pad_to=4)
    with pytest.raises(ValueError, match="no document mask"):
        collate(rows, pad_token_id=0, attn_implementation="flash_attention_2")


def test_collate_refuses_a_predictable_document_start():
    rows = pack_examples(_batch([[5, 6], [8, 9]], [[-100, 6], [-100, 9]], [0, 1]), 8)
    rows["labels"][0][2] = 8  # would be predicted from the first document's last token
    with pytest.raises(ValueError, match="first token of every document"):
        collate(rows, pad_token_id=0, attn_implementation="sdpa")


def test_document_additive_mask_dtype():
    mask = document_additive_mask(torch.tensor([[0, 0, 1]]), torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask[0, 0, 2, 1].item() == torch.finfo(torch.bfloat16).min


def test_block_mask_matches_additive_mask():
    """The flex BlockMask allows exactly the (query, key) pairs the dense mask allows, and survives a move."""
    rows = pack_examples(_batch([[5, 6, 7], [8, 9], [4]], [[-100, 6, 7], [-100, 9], [-100]], [0, 1, 2]), 8)
    c = collate(rows, pad_token_id=0, attn_implementation="flex_attention", pad_to=8)
    c = batch_to_device(c, "cpu", "flex_attention")
    block_mask = c["attention_mask"]
    assert block_mask.shape == (1, 1, 8, 8)
    q, k = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    allowed = block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q, k)
    dense = document_additive_mask(c["document_ids"])[0, 0] == 0
    assert torch.equal(allowed, dense)


def test_token_loss_sum_empty_is_zero_with_a_graph():
    # A micro-batch with no target tokens still backpropagates (zero gradients), so ranks stay in step.
    logits = torch.randn(1, 3, 5, requires_grad=True)
    loss, n = token_loss_sum(logits, torch.full((1, 3), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0 and n.item() == 0 and logits.grad.abs().sum().item() == 0


def test_token_loss_sum_shifts_and_skips_ignored():
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[IGNORE_INDEX, 3, IGNORE_INDEX, 1]])
    loss, n = token_loss_sum(logits, labels)
    want = -(logits[0, 0].log_softmax(-1)[3] + logits[0, 2].log_softmax(-1)[1])
    assert n.item() == 2
    torch.testing.assert_close(loss, want)


# --------------------------------------------------------------------------------------------------
# (b), (c) equivalence with the tiny model
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def examples(tokenizer) -> dict[str, np.ndarray]:
    """Five real tokenized translation pairs of different lengths, loss only on the answer + eos."""
    pairs = [
        ("It is he.", "是他。"),
        ("Tom got drunk with his friends in the park.", "汤姆和他的朋友们在公园喝醉了"),
        ("Thank you.", "谢谢。"),
        ("Tom isn't going to give me that.", "汤姆不会给我那个的。"),
        ("Where is the station?", "车站在哪里？"),
    ]
    instruction = "Translate the following segment into Chinese, without additional explanation."
    ids, labels = [], []
    for src, tgt in pairs:
        user = {"role": "user", "content": f"{instruction}\n\n{src}"}
        prompt = tokenizer.apply_chat_template([user], tokenize=False)
        full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": tgt}], tokenize=False)
        p = tokenizer(prompt, add_special_tokens=False).input_ids
        f = tokenizer(full, add_special_tokens=False).input_ids
        assert f[: len(p)] == p
        ids.append(f)
        labels.append([IGNORE_INDEX] * len(p) + f[len(p) :])
    lengths = [len(x) for x in ids]
    assert len(set(lengths)) == len(lengths), lengths
    return _batch(ids, labels, np.arange(100, 100 + len(ids)))


@pytest.fixture(scope="module")
def models(tokenizer):
    """The tiny model once per attention implementation, same weights (same seed), eval mode."""
    return {impl: load_model("tiny", tokenizer, attn_implementation=impl).eval() for impl in ATTN_IMPLEMENTATIONS}


@pytest.fixture(scope="module")
def reference(models, examples):
    """Per example: (logits [n,V], loss_sum, n_tokens), run alone through eager attention, no mask."""
    out = []
    for ids, labels in zip(examples["input_ids"], examples["labels"], strict=True):
        x = torch.as_tensor(ids, dtype=torch.long)[None]
        with torch.no_grad():
            logits = models["eager"](input_ids=x, use_cache=False).logits
        loss, n = token_loss_sum(logits, torch.as_tensor(labels, dtype=torch.long)[None])
        out.append((logits[0], loss, n))
    return out


def _forward(model, c, attention_mask=None):
    # Static shapes for compiled flex attention: in torch 2.13 the CPU flex kernel with a dynamic batch size
    # fails to compile (inductor CppCompileError), which automatic dynamic shapes would trigger here.
    with torch.no_grad(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        return model(
            input_ids=c["input_ids"],
            attention_mask=c["attention_mask"] if attention_mask is None else attention_mask,
            position_ids=c["position_ids"],
            use_cache=False,
        ).logits


def _documents(c):
    """(row, start, end) of every document in a collated batch, in example order."""
    spans = []
    for r, lens in enumerate(c["seq_lens"]):
        ends = np.cumsum(lens)
        spans += [(r, int(e - n), int(e)) for n, e in zip(lens, ends)]
    return spans


def _assert_matches_reference(c, logits, reference, example_ids):
    order = [int(e) - 100 for e in np.concatenate(c["example_ids"])]
    assert order == list(example_ids)
    for (r, s, e), i in zip(_documents(c), order, strict=True):
        ref_logits, ref_loss, ref_n = reference[i]
        assert (logits[r, s:e] - ref_logits).abs().max().item() < TOL, f"logits of example {i}"
        loss, n = token_loss_sum(logits[r : r + 1, s:e], c["labels"][r : r + 1, s:e])
        assert n.item() == ref_n.item() > 0
        torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=TOL)
    # The whole batch's loss is the sum over examples: no term crosses a document boundary.
    total, n_total = token_loss_sum(logits, c["labels"])
    assert n_total.item() == c["num_target_tokens"].item() == sum(x[2].item() for x in reference)
    torch.testing.assert_close(total, sum(x[1] for x in reference), rtol=TOL, atol=TOL)


@pytest.fixture(scope="module")
def packed(examples):
    rows = pack_examples(examples, max_tokens=PACK_TOKENS)
    # 5 examples of 32..50 tokens into rows of <= 120: [34, 50, 32] and [42, 36] (padded by 42 tokens).
    assert [len(s) for s in rows["seq_lens"]] == [3, 2]
    return rows


@pytest.mark.parametrize("impl", ATTN_IMPLEMENTATIONS)
def test_packed_equals_one_by_one(impl, models, packed, reference, tokenizer):
    c = collate(packed, pad_token_id=tokenizer.pad_token_id, attn_implementation=impl, pad_to=PACK_TOKENS)
    _assert_matches_reference(c, _forward(models[impl], c), reference, range(5))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_position_restart_alone_does_not_isolate(impl, models, packed, reference, tokenizer):
    """Restarted position ids with a plain 2-D padding mask: later documents see earlier ones."""
    c = collate(packed, pad_token_id=tokenizer.pad_token_id, attn_implementation=impl, pad_to=PACK_TOKENS)
    padding_mask = (c["document_ids"] != PAD_DOCUMENT_ID).long()
    logits = _forward(models[impl], c, attention_mask=padding_mask)
    order = [int(e) - 100 for e in np.concatenate(c["example_ids"])]
    for (r, s, e), i in zip(_documents(c), order, strict=True):
        diff = (logits[r, s:e] - reference[i][0]).abs().max().item()
        if s == 0:
            assert diff < TOL  # the first document of a row has nothing before it
        else:
            assert diff > 1e-3, f"example {i} was isolated without a document mask"


@pytest.mark.parametrize("impl", ATTN_IMPLEMENTATIONS)
def test_padded_rows_equal_one_by_one(impl, models, examples, reference, tokenizer):
    c = collate(as_single_rows(examples), pad_token_id=tokenizer.pad_token_id, attn_implementation=impl)
    assert c["input_ids"].shape[1] % 8 == 0 and (c["labels"] == IGNORE_INDEX).any()
    _assert_matches_reference(c, _forward(models[impl], c), reference, range(5))
