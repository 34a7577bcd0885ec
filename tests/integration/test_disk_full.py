"""A full disk under ``run.storage_root`` never leaves a run unresumable: ``hymt train`` run as a user runs it
(the console script, in a subprocess that starts its own local Ray), real Ray Train, DeepSpeed ZeRO-2, 2 CPU
workers, the tiny model. The failed submission ends with one line naming the storage root and the last
whole checkpoint; the same command, submitted again, resumes from that checkpoint.

Injected: the ``enospc`` fault (``train/faults.py``) stands in for the disk filling up while rank 0's
checkpoint of step 4 is copied into storage: it leaves an empty ``state.json`` and an empty
``complete/rank0`` in ``checkpoint_step00000004``, as a cut-off copy does, and raises ``OSError(ENOSPC)``.
Real: a small tmpfs mounted as ``run.storage_root`` (root only; skipped where mounting is not permitted),
grown with a remount to stand in for the user freeing space. MLflow's sqlite store lives outside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fault_tolerance_common import overrides
from raytrain_hymt.train.checkpoint import check_checkpoint, list_checkpoints

HYMT = Path(sys.executable).with_name("hymt")
STEPS = 6


def _hymt_train(storage: Path, name: str, env: dict | None = None, **extra) -> subprocess.CompletedProcess:
    sets = [a for kv in overrides(str(storage), name, **{"optim.max_steps": STEPS, **extra}) for a in ("--set", kv)]
    env = {**os.environ, **(env or {})}
    env.pop("HYMT_VERBOSE", None)
    return subprocess.run([str(HYMT), "train", *sets], capture_output=True, text=True, env=env, timeout=900)


def _shown(run: subprocess.CompletedProcess) -> str:
    return f"exit {run.returncode}\n--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-6000:]}"


def _error_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("error:")]


def _resubmit(storage: Path, name: str, record: Path, **extra) -> subprocess.CompletedProcess:
    """The same command again, recording the steps each rank trains (``HYMT_RECORD_DIR``)."""
    return _hymt_train(storage, name, env={"HYMT_RECORD_DIR": str(record)}, **extra)


def _check_resumed(run: subprocess.CompletedProcess, run_dir: Path, whole: str, cut: str | None,
                   record: Path) -> None:
    """The resubmission trained exactly the steps after the last whole checkpoint and saved whole ones."""
    assert run.returncode == 0, _shown(run)
    resumed_at = int(Path(whole).name.removeprefix("checkpoint_step"))
    trained = [json.loads(line)["step"] for line in (record / "rank0.jsonl").read_text().splitlines()]
    assert trained == list(range(resumed_at + 1, STEPS + 1)), _shown(run)
    assert "Traceback" not in run.stderr, _shown(run)
    if cut is not None:  # the cut-off checkpoint is skipped with one warning that names it
        warned = [line for line in run.stderr.splitlines() if cut in line]
        assert len(warned) == 1 and "not resuming from" in warned[0], _shown(run)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    import pyarrow.fs

    fs = pyarrow.fs.LocalFileSystem()
    newest = list_checkpoints(fs, str(run_dir))[0]
    assert check_checkpoint(fs, str(run_dir / newest)).step == STEPS


def test_an_injected_enospc_at_a_checkpoint_write_ends_in_one_line_and_the_resubmission_resumes(tmp_path):
    storage, name = tmp_path / "runs", "full"
    run_dir = storage / name
    fault = [{"kind": "enospc", "rank": 0, "step": 4, "run_dir": str(run_dir), "once": str(tmp_path / "fired")}]
    first = _hymt_train(storage, name, env={"HYMT_FAULTS": json.dumps(fault)}, **{"checkpoint.max_failures": 0})

    cut = run_dir / "checkpoint_step00000004"
    assert (cut / "state.json").stat().st_size == 0 and (cut / "complete" / "rank0").stat().st_size == 0
    whole = run_dir / "checkpoint_step00000002"
    record = tmp_path / "record"
    second = _resubmit(storage, name, record)  # before the first run's checks: a failure shows both runs
    both = f"{_shown(first)}\n=== resubmitted:\n{_shown(second)}"
    assert first.returncode == 1, both
    assert _error_lines(first) == [
        f"error: no space left on device under run.storage_root {storage} (training failed on rank 0: OSError: "
        f"[Errno 28] No space left on device: '{cut}/state.json'); free space and submit the run again with the "
        f"same name: it resumes from its last whole checkpoint, {whole}"
    ], both
    assert "Traceback" not in first.stderr, both
    _check_resumed(second, run_dir, str(whole), str(cut), record)


def _mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip() or done.returncode})")


def test_a_real_full_filesystem_ends_in_one_line_and_the_resubmission_resumes(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    storage, name = tmp_path / "small", "full"
    run_dir = storage / name
    # MLflow's store is outside the small filesystem (its own failures on a full disk are MLflow's).
    tracking = {"tracking.enabled": True, "tracking.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    _mount_tmpfs(storage, SMALL)
    try:
        first = _hymt_train(storage, name, **{"checkpoint.max_failures": 0, **tracking})
        assert first.returncode == 1, _shown(first)
        (line,) = _error_lines(first)
        whole = list_checkpoints_whole(run_dir)
        assert line.startswith(f"error: no space left on device under run.storage_root {storage} ("), _shown(first)
        assert line.endswith(f"free space and submit the run again with the same name: it resumes from its last "
                             f"whole checkpoint, {whole}"), _shown(first)
        assert "Traceback" not in first.stderr, _shown(first)
        subprocess.run(["mount", "-o", "remount,size=512m", str(storage)], check=True)
        record = tmp_path / "record"
        _check_resumed(_resubmit(storage, name, record, **tracking), run_dir, whole, None, record)
    finally:
        subprocess.run(["umount", "-l", str(storage)], check=False)


#: The small filesystem: one checkpoint of the tiny model (29 MB) and the run's small files fit, a second
#: does not.
SMALL = "45m"


def list_checkpoints_whole(run_dir: Path) -> str:
    """The newest checkpoint of ``run_dir`` that ``check_checkpoint`` accepts."""
    import pyarrow.fs

    from raytrain_hymt.train.checkpoint import IncompleteCheckpointError

    fs = pyarrow.fs.LocalFileSystem()
    for name in list_checkpoints(fs, str(run_dir)):
        try:
            check_checkpoint(fs, str(run_dir / name))
            return str(run_dir / name)
        except (IncompleteCheckpointError, ValueError):
            continue
    raise AssertionError(f"no whole checkpoint in {run_dir}")
