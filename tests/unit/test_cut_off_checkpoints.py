"""Checkpoints are whole or ignored: a state or marker file that a full disk left empty, short or unparsable
makes its checkpoint incomplete (skipped with one warning), never an error; the one line a full disk ends
with. The checkpoint folders are written by hand here, as a cut-off copy leaves them."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pyarrow.fs
import pytest

from raytrain_hymt.driver.resume import newest_checkpoint_state
from raytrain_hymt.errors import disk_full, no_space
from raytrain_hymt.storage import RunFolder
from raytrain_hymt.train.checkpoint import IncompleteCheckpointError, check_checkpoint, newest_whole_checkpoint

FS = pyarrow.fs.LocalFileSystem()


def _whole(folder: Path, step: int) -> Path:
    """A whole one-rank checkpoint of ``step`` (a state, a shard, a marker listing both with their sizes)."""
    (folder / "complete").mkdir(parents=True)
    (folder / "state.json").write_text(json.dumps({"step": step, "epoch": 0, "batch_in_epoch": step, "world_size": 1,
                                                   "tag": f"step{step:08d}", "zero_stage": 2}))
    (folder / "shard.pt").write_bytes(b"x" * 10)
    sizes = {"state.json": (folder / "state.json").stat().st_size, "shard.pt": 10}
    (folder / "complete" / "rank0").write_text(json.dumps({"files": sizes}))
    return folder


@pytest.mark.parametrize(("file", "content", "says"), [
    ("state.json", b"", "state.json is empty (cut off while it was written)"),
    ("state.json", b'{"step": 4, "ep', "state.json is cut off or damaged (15 bytes; JSONDecodeError: Unterminated string"),
    ("state.json", b'{"step": 4}', "state.json is cut off or damaged (11 bytes; TypeError: "),
    ("complete/rank0", b"", "complete/rank0 is empty (cut off while it was written)"),
    ("complete/rank0", b"\0\0\0\0", "complete/rank0 is cut off or damaged (4 bytes; JSONDecodeError: "),
    ("complete/rank0", b'{"sizes": {}}', "complete/rank0 is cut off or damaged (13 bytes; KeyError: 'files')"),
])
def test_an_empty_short_or_unparsable_state_or_marker_makes_the_checkpoint_incomplete(tmp_path, file, content, says):
    ckpt = _whole(tmp_path / "checkpoint_step00000004", 4)
    assert check_checkpoint(FS, str(ckpt)).step == 4
    (ckpt / file).write_bytes(content)
    with pytest.raises(IncompleteCheckpointError) as caught:
        check_checkpoint(FS, str(ckpt))
    assert str(caught.value).startswith(f"{ckpt}: {says}")


def test_the_newest_whole_checkpoint_skips_cut_off_ones_with_one_warning_each(tmp_path, caplog):
    run = tmp_path / "run"
    _whole(run / "checkpoint_step00000002", 2)
    cut = _whole(run / "checkpoint_step00000004", 4)
    (cut / "state.json").write_bytes(b"")
    (cut / "complete" / "rank0").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="raytrain_hymt"):
        name, state = newest_whole_checkpoint(FS, str(run))
    assert (name, state.step) == ("checkpoint_step00000002", 2)
    assert [r.getMessage() for r in caplog.records] == [
        f"not resuming from {cut}: state.json is empty (cut off while it was written)"]
    # The driver's resume check reads the same checkpoint: its state as a dict, no JSONDecodeError.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="raytrain_hymt"):
        name, state = newest_checkpoint_state(RunFolder(str(tmp_path), "run", create=False))
    assert (name, state["step"]) == ("checkpoint_step00000002", 2) and len(caplog.records) == 1
    (run / "checkpoint_step00000002" / "state.json").write_bytes(b"")
    assert newest_whole_checkpoint(FS, str(run), warn=False) is None


def test_a_full_disk_is_recognised_through_its_wrappers_and_ends_in_one_line():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/runs/r/checkpoint_step00000004/state.json")
        except OSError as e:
            raise RuntimeError("the upload failed") from e
    except RuntimeError as e:
        wrapped = e
    assert no_space(wrapped)
    assert no_space(RuntimeError("sqlite3.OperationalError: database or disk is full"))
    assert not no_space(OSError(errno.EACCES, "Permission denied"))
    assert disk_full(wrapped, "/runs", "/runs/r/checkpoint_step00000002") == (
        "no space left on device under run.storage_root /runs (OSError: [Errno 28] No space left on device: "
        "'/runs/r/checkpoint_step00000004/state.json'); free space and "
        "submit the run again with the same name: it resumes from its last whole checkpoint, "
        "/runs/r/checkpoint_step00000002")
    assert disk_full(wrapped, "/runs", None).endswith("it starts over (it has no whole checkpoint yet)")
