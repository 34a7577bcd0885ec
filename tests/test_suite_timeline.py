"""scripts/suite_timeline.py: what its reports say about a recorded run (a small one written here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import suite_timeline  # noqa: E402


def test_python_processes_are_named_by_their_script_or_module():
    kind = suite_timeline._command_kind
    assert kind(["/v/bin/python", "-m", "pytest", "-q", ""]) == "python -m pytest"
    assert kind(["/v/bin/python", "-u", "/v/lib/ray/_private/log_monitor.py", "--x", ""]) == "python log_monitor.py"
    assert kind(["/v/bin/python", "-B", "-c", "from multiprocessing import x", ""]) == "python -c"
    assert kind(["python", ""]) == "python"


def test_this_process_is_seen_with_its_cpu_time():
    seen: dict[str, dict] = {}
    suite_timeline._processes(seen)
    mine = [p for key, p in seen.items() if key.startswith(f"{os.getpid()}@")]
    assert len(mine) == 1 and mine[0]["name"].startswith("python") and mine[0]["cpu"] > 0


def _write_recorded_run(folder: Path) -> None:
    (folder / "cpu.jsonl").write_text("".join(json.dumps({"t": t, "busy": 10.0}) + "\n" for t in range(4)))
    (folder / "processes.json").write_text(json.dumps({
        "1@5": {"name": "ray::RayTrainWorker", "cpu": 12.0}, "2@6": {"name": "ray::RayTrainWorker", "cpu": 8.0},
        "3@7": {"name": "python -m pytest", "cpu": 6.0}, "4@8": {"name": "ray::IDLE", "cpu": 0.5}}))


def test_processes_report_sums_by_kind_against_the_machine(tmp_path, capsys):
    _write_recorded_run(tmp_path)
    suite_timeline.report_processes(tmp_path)
    assert capsys.readouterr().out.splitlines() == [
        "40 CPU-s on the machine; the processes seen account for 26 (66%)",
        "  CPU-s  share  processes  CPU-s each  kind",
        "   20.0  50.0%          2        10.0  ray::RayTrainWorker",
        "    6.0  15.0%          1         6.0  python -m pytest",
    ]


def test_a_report_whose_reader_has_gone_ends_without_a_traceback(tmp_path):
    """`report DIR --processes | head -1`: the reader closes the pipe before the report is written."""
    _write_recorded_run(tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails, as after `head` has read its line and left
    try:
        done = subprocess.run([sys.executable, suite_timeline.__file__, "report", str(tmp_path), "--processes"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == -signal.SIGPIPE  # as `cat` or `ls` would end


def test_fits_report_gives_each_test_the_controllers_and_workers_started_during_it(tmp_path, capsys):
    hz = suite_timeline.HZ
    (tmp_path / "btime").write_text("1000\n")
    (tmp_path / "phases.jsonl").write_text("".join(json.dumps(p) + "\n" for p in [
        {"id": "tests/test_a.py::test_one", "when": "call", "start": 1010.0, "stop": 1020.0},
        {"id": "tests/test_b.py::test_two", "when": "setup", "start": 1020.5, "stop": 1030.0}]))
    (tmp_path / "processes.json").write_text(json.dumps({  # keyed by pid @ start ticks after boot
        f"1@{11 * hz}": {"name": "ray::TrainController", "cpu": 3.0},
        f"2@{12 * hz}": {"name": "ray::RayTrainWorker", "cpu": 10.0},
        f"3@{12 * hz}": {"name": "ray::RayTrainWorker", "cpu": 9.0},
        f"4@{21 * hz}": {"name": "ray::TrainController", "cpu": 2.0},
        f"5@{21 * hz}": {"name": "ray::RayTrainWorker", "cpu": 30.0},
        f"6@{int(20.2 * hz)}": {"name": "ray::RayTrainWorker", "cpu": 1.0},  # between the two tests
        f"7@{12 * hz}": {"name": "ray::MapWorker(MapBatches(TokenizePairs))", "cpu": 5.0}}))
    suite_timeline.report_fits(tmp_path)
    assert capsys.readouterr().out.splitlines() == [
        " fits  workers   CPU-s  test",
        "    1        1    32.0  tests/test_b.py::test_two",
        "    1        2    22.0  tests/test_a.py::test_one",
        "    0        1     1.0  (between tests)",
        "    2        4    55.0  in all",
    ]
