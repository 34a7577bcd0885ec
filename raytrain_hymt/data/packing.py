"""Sequence packing with document masking, the shared collate, and the summed token loss.

Two row layouts feed one collate:

* packing (:func:`pack_examples`): several tokenized examples concatenated into one row of at most
  ``max_tokens`` tokens, greedy next-fit in input order;
* padding (:func:`as_single_rows`): one example per row.

Both produce the same columns (one value per row; variable-length columns are object arrays of 1-D numpy
arrays, which Ray Data stores as variable-shaped tensors):

============================  =========  ========================================================
column                        dtype      meaning
============================  =========  ========================================================
``input_ids``                 int32[n]   token ids of the examples, back to back
``labels``                    int32[n]   target ids, ``-100`` where no loss is taken (prompt, and
                                         always the first token of every example, see below)
``position_ids``              int32[n]   0, 1, ... restarting at 0 for every example
``seq_lens``                  int32[k]   length of each of the k examples in the row
``example_ids``               int64[k]   ``example_id`` of each example in the row
``num_target_tokens``         int64      ``labels != -100`` in the row: exactly the terms that
                                         :func:`token_loss_sum` adds for this row
============================  =========  ========================================================

Why the row layout alone is not enough, and what the collate does about it (transformers 5.24, read in
``masking_utils.py`` and ``models/hunyuan_v1_dense/modeling_hunyuan_v1_dense.py``):

* ``HunYuanDenseV1Model.forward`` passes ``attention_mask`` to ``create_causal_mask``, whose
  ``_preprocess_mask_arguments`` returns any 4-D mask -- a ``torch.Tensor`` of shape ``[B,1,L,L]`` or a
  flex-attention ``BlockMask`` (its ``.shape`` is 4-D too) -- unchanged ("early exit"). No code path then
  adds or replaces a causal mask: the sdpa integration sets ``is_causal=False`` whenever a mask is given,
  eager adds the mask to the scores, flex passes a ``BlockMask`` as ``block_mask``. So the mask must itself
  be causal *and* block-diagonal, which is what :func:`document_attention_mask` builds.
* A 2-D ``[B,L]`` padding mask is turned into a plain causal+padding mask: restarted ``position_ids`` only
  change RoPE, and attention crosses examples (``tests/unit/test_packing.py`` proves it).
* With ``attention_mask=None`` (and no cache) transformers 5.24 itself infers documents from restarts in
  ``position_ids`` (``find_packed_sequence_indices``). We do not rely on that: it is silently off as soon
  as any 2-D mask or a cache is passed, and padding would merge into the last document.
* The eager path adds the mask to the scores, so it needs the additive float form (0 / dtype-min); sdpa
  accepts the same. Float32 masks work with bf16 queries (sdpa and eager); ``mask_dtype`` can halve the
  memory.

The first token of every example never has a loss: nothing of its own document precedes it. In a packed
row the shifted loss would otherwise predict it from the previous example's last token, so the rows built
here always carry ``-100`` there (for the tokenized pairs it is the ``<|startoftext|>`` prompt token anyway,
so this changes nothing for them), and :func:`collate` refuses rows that do not.
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import TYPE_CHECKING

import numpy as np

# torch only where tensors are made (collate, masks, loss): every Ray worker that packs or tokenizes
# imports this module, and importing torch there costs seconds of start-up per worker process.
if TYPE_CHECKING:
    import torch

#: Label value that takes no loss (the ``ignore_index`` of PyTorch's cross-entropy).
IGNORE_INDEX = -100
#: Document id of padding tokens: padding forms its own causal "document", so no query row is fully
#: masked (a fully masked row would make sdpa return NaN) and no real token ever sees padding.
PAD_DOCUMENT_ID = -1
#: Attention implementations :func:`document_attention_mask` can mask.
MASKED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")


def object_array(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """A 1-D object array holding ``arrays`` (filled one by one: ``np.array`` would stack equal lengths)."""
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def _rows(column) -> list[np.ndarray]:
    """The rows of a variable-length column: an object array of arrays, or a 2-D array when Ray Data
    stacked a batch whose rows happen to have equal lengths."""
    return [np.asarray(row) for row in column]


def next_fit_bounds(lengths: Sequence[int], max_tokens: int) -> np.ndarray:
    """Boundaries of ``lengths`` grouped greedily, next-fit, in input order: group ``g`` is
    ``lengths[bounds[g]:bounds[g + 1]]``, and a new group starts when the next length does not fit into
    the current one. Deterministic; raises ``ValueError`` on a length > max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bounds = [0]
    used = 0
    for i, n in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        if n > max_tokens:
            raise ValueError(f"item {i} has {n} tokens > max_tokens={max_tokens}")
        if used + n > max_tokens and i:
            bounds.append(i)
            used = 0
        used += n
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


def _split(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``values[offsets[i]:offsets[i + 1]]`` for every ``i``, as an object array of views."""
    return object_array([values[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())])


def _flatten(column, name: str, eids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A variable-length column as one int32 array plus example offsets (one concatenation)."""
    rows = _rows(column)
    if len(rows) != len(eids):
        raise ValueError(f"{len(rows)} {name} rows but {len(eids)} example ids")
    lengths = np.fromiter((r.size for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate([r.reshape(-1) for r in rows]).astype(np.int32, copy=False) if rows else np.zeros(0, np.int32)
    return values, offsets


def _read_examples(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids, labels, example offsets, example_id)`` of a tokenized batch, flattened and validated
    (other columns are ignored); labels are a copy with every example's first label ``-100`` (module
    docstring)."""
    eids = np.asarray(batch["example_id"], dtype=np.int64).reshape(-1)
    ids, offsets = _flatten(batch["input_ids"], "input_ids", eids)
    labels, label_offsets = _flatten(batch["labels"], "labels", eids)
    lengths = np.diff(offsets)
    mismatch = np.flatnonzero(lengths != np.diff(label_offsets))
    if mismatch.size:
        i = mismatch[0]
        raise ValueError(f"example_id {eids[i]}: {lengths[i]} input_ids but {label_offsets[i + 1] - label_offsets[i]} labels")
    if (lengths == 0).any():
        raise ValueError(f"example_id {eids[np.flatnonzero(lengths == 0)[0]]} has no tokens")
    labels = labels.copy()
    labels[offsets[:-1]] = IGNORE_INDEX
    return ids, labels, offsets, eids


def _build_rows(bounds: np.ndarray, ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray, eids: np.ndarray) -> dict:
    """The packed-row columns (module docstring): row ``g`` holds examples ``bounds[g]:bounds[g + 1]``,
    which are contiguous in the flat token arrays, so every row is a slice of them."""
    lengths = np.diff(offsets).astype(np.int32)
    row_offsets = offsets[bounds]
    positions = (np.arange(ids.size, dtype=np.int64) - np.repeat(offsets[:-1], lengths)).astype(np.int32)
    targets = np.concatenate([[0], np.cumsum(labels != IGNORE_INDEX)])
    return {
        "input_ids": _split(ids, row_offsets),
        "labels": _split(labels, row_offsets),
        "position_ids": _split(positions, row_offsets),
        "seq_lens": _split(lengths, bounds),
        "example_ids": _split(eids, bounds),
        "num_target_tokens": (targets[row_offsets[1:]] - targets[row_offsets[:-1]]).astype(np.int64),
    }


def pack_examples(batch: dict[str, np.ndarray], max_tokens: int) -> dict[str, np.ndarray]:
    """Pack a tokenized batch into rows of at most ``max_tokens`` tokens (Ray Data ``map_batches``,
    ``batch_format="numpy"``).

    Greedy next-fit in input order: a new row starts when the next example does not fit, so the result
    depends only on the batch (packs never span batches: ``map_batches``' ``batch_size`` sets how full
    the rows get). Output columns: see the module docstring. An example longer than ``max_tokens`` raises
    ``ValueError``: tokenization drops those (``too_many_tokens``), so reaching here is a bug upstream.
    """
    ids, labels, offsets, eids = _read_examples(batch)
    lengths = np.diff(offsets)
    too_long = np.flatnonzero(lengths > max_tokens)
    if too_long.size:
        i = too_long[0]
        raise ValueError(
            f"example_id {int(eids[i])} has {lengths[i]} tokens > max_tokens={max_tokens}; tokenization "
            "must drop examples longer than the pack size before packing"
        )
    return _build_rows(next_fit_bounds(lengths, max_tokens), ids, labels, offsets, eids)


def as_single_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The padding layout: one example per row, in the same columns as :func:`pack_examples`, so both
    layouts share :func:`collate` (Ray Data ``map_batches``, ``batch_format="numpy"``)."""
    ids, labels, offsets, eids = _read_examples(batch)
    return _build_rows(np.arange(eids.size + 1), ids, labels, offsets, eids)


def _padded_length(longest: int, pad_to_multiple_of: int | None, pad_to: int | None) -> int:
    """Row length after padding: ``pad_to`` if given (fixed shapes), else ``longest`` rounded up."""
    if pad_to is not None:
        if longest > pad_to:
            raise ValueError(f"a row has {longest} tokens > pad_to={pad_to}")
        return pad_to
    m = pad_to_multiple_of or 1
    return -(-longest // m) * m


def document_additive_mask(document_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[B,1,L,L]`` additive mask from per-token document ids ``[B,L]``: 0 where query ``q`` may attend
    key ``k`` (same document, ``k <= q``), ``torch.finfo(dtype).min`` elsewhere (the form eager needs);
    ``dtype`` defaults to float32."""
    import torch

    dtype = dtype or torch.float32
    L = document_ids.shape[-1]
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(L, L, dtype=torch.bool, device=document_ids.device).tril()
    allowed = (same_doc & causal)[:, None]
    zero = torch.zeros((), dtype=dtype, device=document_ids.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def document_block_mask(document_ids: torch.Tensor):
    """Flex-attention ``BlockMask`` (causal, within one document) from per-token document ids ``[B,L]``.

    The mask function reads ``document_ids`` on its device, so build it on the device that runs the
    model (:func:`batch_to_device` rebuilds it after a move).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    B, L = document_ids.shape

    def document_causal(b, h, q_idx, kv_idx):
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(document_causal, B, None, L, L, device=document_ids.device)


def document_attention_mask(
    document_ids: torch.Tensor, attn_implementation: str, *, dtype: torch.dtype | None = None
):
    """The document mask ``attn_implementation`` takes as ``attention_mask``: a ``BlockMask`` for
    ``"flex_attention"``, the ``[B,1,L,L]`` additive float mask (``dtype``, default float32) for
    ``"sdpa"`` and ``"eager"``."""
    if attn_implementation == "flex_attention":
        return document_block_mask(document_ids)
    if attn_implementation in ("sdpa", "eager"):
        return document_additive_mask(document_ids, dtype)
    raise ValueError(
        f"no document mask for attn_implementation={attn_implementation!r}; "
        f"use one of {MASKED_ATTN_IMPLEMENTATIONS}"
    )


def collate(
    batch: dict[str, np.ndarray],
    *,
    pad_token_id: int,
    attn_implementation: str,
    pad_to_multiple_of: int | None = 8,
    pad_to: int | None = None,
    mask_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor | object]:
    """Pad rows of :func:`pack_examples` / :func:`as_single_rows` into model inputs with a document mask.

    Rows are right-padded to the longest row rounded up to ``pad_to_multiple_of`` (or to exactly
    ``pad_to``). Returns ``input_ids``, ``labels`` (``-100`` on padding), ``position_ids`` (long
    ``[B,L]``), ``document_ids`` (``[B,L]``, :data:`PAD_DOCUMENT_ID` on padding), ``attention_mask``
    (:func:`document_attention_mask`: each example sees only itself, causally), ``num_target_tokens``
    (0-d long tensor: the tokens :func:`token_loss_sum` will count), and, for bookkeeping, ``example_ids``
    and ``seq_lens`` (lists of numpy arrays, one per row). Tensors are built on ``device`` (default CPU).
    Pass ``input_ids``, ``attention_mask`` and ``position_ids`` to the model (and ``use_cache=False``).
    """
    import torch

    ids, labs, pos = _rows(batch["input_ids"]), _rows(batch["labels"]), _rows(batch["position_ids"])
    seq_lens = [r.astype(np.int32) for r in _rows(batch["seq_lens"])]
    B = len(ids)
    if B == 0:
        raise ValueError("collate got an empty batch")
    L = _padded_length(max(r.size for r in ids), pad_to_multiple_of, pad_to)

    input_ids = np.full((B, L), pad_token_id, dtype=np.int64)
    labels = np.full((B, L), IGNORE_INDEX, dtype=np.int64)
    # Padding continues as its own little sequence 0, 1, ...: harmless, it is masked out.
    position_ids = np.tile(np.arange(L, dtype=np.int64), (B, 1))
    document_ids = np.full((B, L), PAD_DOCUMENT_ID, dtype=np.int64)
    for r in range(B):
        n = ids[r].size
        if int(seq_lens[r].sum()) != n:
            raise ValueError(f"row {r}: seq_lens sum to {int(seq_lens[r].sum())} but the row has {n} tokens")
        starts = np.concatenate([[0], np.cumsum(seq_lens[r])[:-1]])
        if (labs[r][starts] != IGNORE_INDEX).any():
            # Otherwise the shifted loss would predict a document's first token from the previous one.
            raise ValueError(f"row {r}: the first token of every document must have label {IGNORE_INDEX}")
        input_ids[r, :n] = ids[r]
        labels[r, :n] = labs[r]
        position_ids[r, :n] = pos[r]
        position_ids[r, n:] = np.arange(L - n)
        document_ids[r, :n] = np.repeat(np.arange(seq_lens[r].size), seq_lens[r])

    out: dict[str, torch.Tensor | object] = {
        "input_ids": torch.from_numpy(input_ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(position_ids),
        "document_ids": torch.from_numpy(document_ids),
    }
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    out["attention_mask"] = document_attention_mask(out["document_ids"], attn_implementation, dtype=mask_dtype)
    out["num_target_tokens"] = (out["labels"][:, 1:] != IGNORE_INDEX).sum()
    out["example_ids"] = [np.asarray(e, dtype=np.int64) for e in _rows(batch["example_ids"])]
    out["seq_lens"] = seq_lens
    return out


def batch_to_device(batch: dict, device: torch.device | str, attn_implementation: str) -> dict:
    """Move a :func:`collate` output to ``device``. A ``BlockMask`` is rebuilt there from ``document_ids``
    (its mask function closes over the ids tensor, which ``BlockMask.to`` would leave behind); a dense
    mask is moved as is."""
    import torch

    out = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    if attn_implementation == "flex_attention":
        out["attention_mask"] = document_block_mask(out["document_ids"])
    return out


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted next-token cross-entropy, summed in fp32 over target tokens, and the number of them.

    The label at position ``t`` is predicted by the logits at ``t-1`` (``logits[:, :-1]`` against
    ``labels[:, 1:]``); positions with label ``-100`` are skipped. In a packed row this never crosses a
    document boundary because every document's first label is ``-100`` (guaranteed by the rows built here
    and checked by :func:`collate`). ``n_tokens`` equals ``collate``'s ``num_target_tokens``. Divide by
    the token count of the whole global step, not per micro-batch.
    Only the target positions are upcast to fp32, which keeps the [tokens, vocab] copy small.
    """
    import torch

    shift_labels = labels[:, 1:]
    target = shift_labels != IGNORE_INDEX
    picked = logits[:, :-1][target].float()
    loss_sum = torch.nn.functional.cross_entropy(picked, shift_labels[target], reduction="sum")
    return loss_sum, target.sum()
