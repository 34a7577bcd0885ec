"""Each rank reads only the rows it trains on (issue #16): lanes assigned before anything is read.

The pure tests check the lane layout of :mod:`raytrain_hymt.data.epochs` on numbers. The training tests
run the real stack (Ray Train, DeepSpeed ZeRO-2 fp32, CPU workers, the tiny model) on ~220 packed rows,
global batch 16 rows, windows of 64 rows (lanes and blocks of 4 rows): the rows each rank fetched are
counted where it fetches them (``data.blocks.RowFetcher``: the ``ray.get`` of an object-store block, the
``read_row_group`` of a Parquet row group) and reach the test through the per-step record
(``faults.record_step``), as do the example ids of every rank's rows.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from fault_tolerance_common import attempts, effective, read_records
from raytrain_hymt.config.schema import load_config
from raytrain_hymt.data.epochs import batches, block_rows, lane_layout, rank_lanes, window_rows
from raytrain_hymt.data.stats import DataStats
from raytrain_hymt.data.epochs import rank_rows, rank_slice
from raytrain_hymt.data.files import SAMPLE_CORPUS

# ----------------------------------------------------------------------------------------- pure

G = 4  # global batch rows of the pure tests


def _stream(n: int) -> dict[str, np.ndarray]:
    return {"example_ids": np.arange(n, dtype=np.int64), "x": np.arange(n) * 10}


def _fetcher(rows: dict[str, np.ndarray], log: list | None = None):
    def fetch(ranges):
        if log is not None:
            log.append(list(ranges))
        return {k: np.concatenate([v[a:b] for a, b in ranges]) for k, v in rows.items()}
    return fetch


def _epoch(rows, total, window, lanes, epoch=0, seed=5, skip=0, log=None) -> list[dict]:
    per_epoch = total // G
    it = batches(_fetcher(rows, log), total, window, G, lanes, seed, epoch, skip)
    return [b for _, _, b in islice(it, per_epoch - skip)]


def test_lanes_give_every_row_once_a_new_order_every_epoch_and_reproduce():
    rows = _stream(103)  # windows of 40, 40, 23 rows: lanes of 10, 10 and 5 rows
    assert window_rows(42, G) == 40 and window_rows(3, G) == G
    ids = lambda e, seed=5: [b["example_ids"].tolist() for b in _epoch(rows, 103, 40, range(G), e, seed)]  # noqa: E731
    first, second = ids(0), ids(1)
    assert first == ids(0) and second == ids(1) and first != second and ids(0, seed=6) != first
    assert len(first) == len(second) == 103 // G and all(len(b) == G for b in first)
    for epoch in (first, second):
        flat = [e for b in epoch for e in b]
        assert len(set(flat)) == len(flat)  # no row twice in an epoch
        assert set(flat[:40]) == set(range(40))  # rows move only within their window
        # Position j of a batch of window 0 always comes from lane j, rows [10 j, 10 j + 10).
        assert all(10 * j <= b[j] < 10 * j + 10 for b in epoch[:10] for j in range(G))
    # The last window leaves 3 of its 23 rows out, at a seeded offset: not the same rows every epoch.
    offsets = {lane_layout(23, G, 5, e, 2)[1] for e in range(8)}
    assert len(offsets) > 1 and offsets <= {0, 1, 2, 3}
    batch = _epoch(rows, 103, 40, range(G))[0]
    assert (batch["x"] == batch["example_ids"] * 10).all()  # the columns stay aligned


@pytest.mark.parametrize("world,accum,micro", [(1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1)])
def test_each_rank_fetches_only_its_lanes_and_the_batches_do_not_depend_on_the_worker_count(world, accum, micro):
    rows = _stream(103)
    whole = _epoch(rows, 103, 40, range(G))
    logs = {r: [] for r in range(world)}
    mine = {r: _epoch(rows, 103, 40, rank_lanes(r, world, accum, micro), log=logs[r]) for r in range(world)}
    for step, batch in enumerate(whole):
        for r in range(world):
            want = rank_rows(batch, r, world, accum, micro)
            assert all(np.array_equal(mine[r][step][k], want[k]) for k in want), (step, r)
            # ... which are rank_slice's micro-step slices, in micro-step order.
            slices = [rank_slice(batch, a, r, world, micro)["example_ids"] for a in range(accum)]
            assert mine[r][step]["example_ids"].tolist() == np.concatenate(slices).tolist()
    for r in range(world):
        fetched = [b - a for call in logs[r] for a, b in call]
        assert len(logs[r]) == 3 and sum(fetched) == 100 // world  # one fetch per window, its share only


def test_a_resume_never_fetches_the_windows_it_skips():
    rows, log = _stream(103), []
    whole = _epoch(rows, 103, 40, range(G))
    resumed = _epoch(rows, 103, 40, range(G), skip=12, log=log)
    assert [b["example_ids"].tolist() for b in resumed] == [b["example_ids"].tolist() for b in whole[12:]]
    assert [call[0][0] for call in log] == [40, 80 + lane_layout(23, G, 5, 0, 2)[1]]  # window 0 never fetched


def test_blocks_are_one_lane_of_a_window():
    cfg = load_config(None, ["optim.global_batch_rows=8", "optim.micro_batch_size=2", "data.epoch_shuffle_rows=35"])
    assert block_rows(cfg) == 4  # windows of 32 rows, 8 lanes of 4
    # A stream shorter than a window: lanes of the stream itself. 1,000 tokens make at least 10 packs of
    # 100 tokens (lanes of 1 row), 63 of 16 (lanes of 7 rows); a window is 96 rows (lanes of 12).
    small = load_config(None, ["optim.global_batch_rows=8", "optim.micro_batch_size=2", "data.epoch_shuffle_rows=99",
                               "data.pack_tokens=100", "data.max_example_tokens=100"])
    assert block_rows(small, DataStats(train_tokens=1000, train_examples=50)) == 1
    small.data.pack_tokens = small.data.max_example_tokens = 16
    assert block_rows(small, DataStats(train_tokens=1000, train_examples=50)) == 7
    small.data.packing = False  # one row per example
    assert block_rows(small, DataStats(train_tokens=1000, train_examples=20)) == 2
    assert block_rows(small, DataStats(train_tokens=1000, train_examples=2000)) == 12  # a window of 96


def test_validation_batches_cross_blocks_and_read_each_block_once(tmp_path):
    """Validation reads every row through ``RowFetcher.batches``: batches of ``world × micro`` rows across
    row-group edges, as ``iter_batches`` gave them, each row group read once; no rows, no batches."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_hymt.data.blocks import ParquetBlocks, RowFetcher

    path = tmp_path / "val.parquet"
    with pq.ParquetWriter(path, pa.schema([("example_ids", pa.int64())])) as writer:
        for start, stop in ((0, 3), (3, 10), (10, 11)):  # row groups of 3, 7 and 1 rows
            writer.write_table(pa.table({"example_ids": np.arange(start, stop)}))
    fetch = RowFetcher(ParquetBlocks([str(path)], [(0, 0), (0, 1), (0, 2)], [3, 7, 1]))
    got = [b["example_ids"].tolist() for b in fetch.batches(4)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert fetch.counts()["blocks_fetched"] == 3 and fetch.counts()["rows_fetched"] == 11
    assert list(RowFetcher(ParquetBlocks([], [], [])).batches(4)) == []  # data.val_fraction 0


class _Tables:
    """Blocks already in memory (the interface of ``ObjectStoreBlocks`` and ``ParquetBlocks``)."""

    def __init__(self, tables):
        self.tables, self.rows = tables, [t.num_rows for t in tables]

    def read(self, index):
        return self.tables[index]


def test_rows_of_blocks_whose_tensor_columns_have_different_shapes_come_together():
    """Ray Data stores a block's list column as a fixed-shape tensor when all its rows have one length
    (packed rows that all hold 2 documents: ``seq_lens`` of shape (2,)), else as a variable-shaped one.
    Rows from blocks of different shapes (a small validation set; short lanes; unpacked rows) failed to
    concatenate (pyarrow: "Schema at index 1 was different") and ended the run at its validation."""
    from ray.data.block import BlockAccessor

    from raytrain_hymt.data.blocks import RowFetcher

    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.array([1, 2, 3]), np.array([6])]
    batches = [{"seq_lens": np.array([[3, 4]]), "input_ids": np.array([[5, 6, 7]]), "example_ids": np.array([0])},
               {"seq_lens": np.array([[1, 2, 4]]), "input_ids": np.array([[8, 9, 10]]), "example_ids": np.array([1])},
               {"seq_lens": ragged, "input_ids": np.array([[1, 1, 1], [2, 2, 2]]), "example_ids": np.array([2, 3])}]
    fetch = RowFetcher(_Tables([BlockAccessor.batch_to_block(b) for b in batches]))
    for rows in (fetch([(0, 4)]), next(fetch.batches(4))):
        assert [r.tolist() for r in rows["seq_lens"]] == [[3, 4], [1, 2, 4], [1, 2, 3], [6]]
        assert rows["input_ids"].tolist() == [[5, 6, 7], [8, 9, 10], [1, 1, 1], [2, 2, 2]]  # one shape: an array
        assert rows["example_ids"].tolist() == [0, 1, 2, 3]
    same = fetch([(0, 1), (2, 4)])  # rows of one shape stay the array iter_batches gives
    assert same["input_ids"].shape == (3, 3) and [r.tolist() for r in same["seq_lens"]] == [[3, 4], [1, 2, 3], [6]]


def test_a_checkpoint_of_the_order_before_lanes_does_not_resume_silently():
    from raytrain_hymt.data.fingerprint import compare_fingerprints, data_fingerprint

    cfg = load_config(None, [])
    new = data_fingerprint(cfg)
    before = {**new, "order": {"seed": 0, "epoch_shuffle_rows": 8192}}  # what a checkpoint of the old order holds
    assert compare_fingerprints(before, new) == ["data.epoch_order: None → 'lanes'"]


# ------------------------------------------------------------------------------------ training

GLOBAL_ROWS, SHUFFLE, BLOCK = 16, 64, 4


def _overrides(storage: Path, name: str, workers: int, **extra) -> list[str]:
    values = {
        "data.sources": f"[{{path: '{storage.parent}/corpus/*.tsv', format: tatoeba}}]", "data.val_fraction": 0.0,
        "data.pack_tokens": 128, "data.max_example_tokens": 128, "data.epoch_shuffle_rows": SHUFFLE,
        "optim.global_batch_rows": GLOBAL_ROWS, "optim.micro_batch_size": 4, "optim.warmup_steps": 0,
        "scaling.num_workers": workers, "run.storage_root": str(storage), "run.name": name, "run.export": False,
        "tracking.enabled": False, "eval.every_steps": 1000, "checkpoint.every_steps": 1000,
    }
    values.update(extra)
    if "data.prepared_path" in extra:  # a prepared dataset trains on the sources it was prepared from
        del values["data.sources"]
    return [f"{k}={v}" for k, v in values.items()]


def _records(folder: Path, workers: int) -> dict[int, list[dict]]:
    return {r: read_records(folder, r) for r in range(workers)}


def _global_ids(records: dict[int, list[dict]]) -> dict[int, list[int]]:
    """Step → the sorted example ids of the whole global batch (every rank's rows, last attempt)."""
    out: dict[int, list[int]] = {}
    for recs in records.values():
        for step, r in effective(recs).items():
            out[step] = sorted(out.get(step, []) + r["example_ids"])
    return out


def _within(fetched: int, trained: float, share: float) -> bool:
    """``fetched`` ≈ ``share`` within 5% plus one block, and never less than the rows the rank trained."""
    return trained <= fetched <= 1.05 * share + BLOCK


def _stream_ids(cfg, train) -> list[list[int]]:
    """Every training row's example ids, in the stream order the ranks' lanes are cut from: the blocks of
    ``train`` in the object store, or the prepared dataset's row groups (``data.prepared_path``)."""
    from raytrain_hymt.data.blocks import RowFetcher, train_blocks

    fetch = RowFetcher(train_blocks(cfg, train))
    return [ids.tolist() for ids in fetch([(0, fetch.total_rows)])["example_ids"]]


RESUME_AT, RESUME_STEPS = 6, 12  # the 2-worker run checkpoints at step 6 (inside window 1), fails at 7


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """The same data trained on 4 workers for one epoch (from the object store, and from a prepared
    dataset written from the same rows), on 2 workers for 12 steps failing after step 6 and resuming,
    and on 1 worker for 4 steps."""
    from raytrain_hymt.data.fingerprint import sources_fingerprint
    from raytrain_hymt.data.pipeline import build_datasets
    from raytrain_hymt.data.prepared import write_prepared
    from raytrain_hymt.driver.train import run_training

    root = tmp_path_factory.mktemp("rank-reading")
    (root / "corpus").mkdir()
    lines = SAMPLE_CORPUS.read_text(encoding="utf-8").splitlines()[:500]
    (root / "corpus" / "corpus.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    storage = root / "runs"
    cfg = lambda name, workers, **extra: load_config(None, _overrides(storage, name, workers, **extra))  # noqa: E731
    built = build_datasets(cfg("m4", 4))
    rows = built[2].train_rows
    per_epoch = rows // GLOBAL_ROWS
    # hymt prepare's writer, on the rows built above (prepare would run the same pipeline again).
    prepared = str(root / "prepared")
    write_prepared(cfg("p", 4), prepared, *built, sources_fingerprint(cfg("p", 4)))
    plan = {
        "m4": (4, {"optim.max_steps": per_epoch}, []),
        "p4": (4, {"optim.max_steps": per_epoch, "data.prepared_path": prepared}, []),
        "r2": (2, {"optim.max_steps": RESUME_STEPS, "checkpoint.every_steps": RESUME_AT, "checkpoint.max_failures": 1},
               [{"kind": "raise", "rank": 1, "step": RESUME_AT + 1, "once": str(root / "raised")}]),
        "w1": (1, {"optim.max_steps": 4}, []),
    }
    mp = pytest.MonkeyPatch()
    try:
        for name, (workers, extra, faults) in plan.items():
            mp.setenv("HYMT_RECORD_DIR", str(root / f"record-{name}"))
            mp.setenv("HYMT_FAULTS", json.dumps(faults))
            prepared_run = "data.prepared_path" in extra
            run_training(cfg(name, workers, **extra), datasets=None if prepared_run else built)
    finally:
        mp.undo()
    records = {name: _records(root / f"record-{name}", plan[name][0]) for name in plan}
    streams = {"m4": _stream_ids(cfg("m4", 4), built[0]), "p4": _stream_ids(cfg("p4", 4, **plan["p4"][1]), None)}
    return {"rows": rows, "per_epoch": per_epoch, "records": records, "streams": streams}


@pytest.mark.integration
def test_each_of_4_ranks_fetches_a_quarter_of_the_rows_per_epoch_from_the_object_store_and_from_parquet(runs):
    rows, per_epoch = runs["rows"], runs["per_epoch"]
    assert rows >= 200 and per_epoch * GLOBAL_ROWS <= rows
    for name in ("m4", "p4"):
        for rank, recs in runs["records"][name].items():
            assert len(attempts(recs)) == 1 and [r["step"] for r in recs] == list(range(1, per_epoch + 1))
            fetched = recs[-1]["rows_fetched"]
            print(f"{name} rank {rank}: fetched {fetched} rows in {recs[-1]['blocks_fetched']} blocks "
                  f"({recs[-1]['bytes_fetched']} bytes) of {rows}")
            assert _within(fetched, per_epoch * GLOBAL_ROWS / 4, rows / 4), (name, rank, fetched, rows)
            assert recs[-1]["blocks_fetched"] * BLOCK >= fetched  # blocks of at most one lane
    # From the object store or from Parquet, the same rows in the same order, so in the same batches.
    assert runs["streams"]["m4"] == runs["streams"]["p4"]
    assert _global_ids(runs["records"]["m4"]) == _global_ids(runs["records"]["p4"])


@pytest.mark.integration
def test_a_resume_fetches_only_what_remains(runs):
    for rank, recs in runs["records"]["r2"].items():
        first, second = attempts(recs)
        assert [r["step"] for r in second] == list(range(RESUME_AT + 1, RESUME_STEPS + 1))
        fetched = second[-1]["rows_fetched"]
        remaining = (RESUME_STEPS - RESUME_AT) * GLOBAL_ROWS // 2  # this rank's rows of the steps left
        print(f"resume rank {rank}: fetched {fetched} rows for {remaining} left "
              f"(first attempt: {first[-1]['rows_fetched']} rows for {len(first)} steps)")
        # Window 0 (steps 1-4) is never fetched again; window 1 (steps 5-8) is, for steps 7 and 8; then
        # window 2 (steps 9-12): 2 windows of 64 rows, 32 of each for this rank.
        assert fetched == 2 * SHUFFLE // 2 and remaining <= fetched <= remaining + SHUFFLE // 2


@pytest.mark.integration
def test_global_batches_are_the_same_on_1_2_and_4_workers(runs):
    four, two, one = (_global_ids(runs["records"][n]) for n in ("m4", "r2", "w1"))
    assert sorted(four) == list(range(1, runs["per_epoch"] + 1))
    assert sorted(two) == list(range(1, RESUME_STEPS + 1)) and sorted(one) == [1, 2, 3, 4]
    assert all(len(ids) >= GLOBAL_ROWS for ids in four.values())  # a packed row holds one example or more
    assert two == {s: four[s] for s in two}  # across a failure and a resume on 2 workers, too
    assert one == {s: four[s] for s in one}

