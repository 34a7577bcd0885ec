"""The test-only ``stall`` fault (``faults.py``): it sleeps its seconds, or less when its ``until`` file appears."""

from __future__ import annotations

import json
import threading
import time

from raytrain_hymt.train import faults


def _stall(monkeypatch, **extra) -> None:
    monkeypatch.setenv(faults.FAULTS_ENV, json.dumps([{"kind": "stall", "rank": 0, "step": 3, **extra}]))


def test_a_stall_holds_only_its_rank_and_step_for_its_seconds(monkeypatch):
    _stall(monkeypatch, seconds=0.5)
    start = time.monotonic()
    faults.before_step(2, 0)
    faults.before_step(3, 1)
    assert time.monotonic() - start < 0.2
    faults.before_step(3, 0)
    assert time.monotonic() - start >= 0.5


def test_a_stall_ends_when_its_until_file_appears(monkeypatch, tmp_path):
    marker = tmp_path / "server-back"
    _stall(monkeypatch, seconds=60, until=str(marker))
    timer = threading.Timer(0.5, marker.touch)
    timer.start()
    start = time.monotonic()
    faults.before_step(3, 0)
    held = time.monotonic() - start
    timer.join()
    assert 0.4 <= held < 5
