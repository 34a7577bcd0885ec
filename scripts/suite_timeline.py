"""Where the test suite's time goes: each test phase's wall time beside the CPU the whole machine spent in it.

    python scripts/suite_timeline.py run OUT_DIR [pytest args ...]   # the suite, sampled (writes OUT_DIR)
    python scripts/suite_timeline.py report OUT_DIR [--files]        # phases (or files), longest first

``run`` starts pytest with this file as a plugin, which appends each phase's start and stop to
``OUT_DIR/phases.jsonl``, while this process reads the machine's busy CPU time from ``/proc/stat`` every
second into ``OUT_DIR/cpu.jsonl``. Ray's workers, actors and clusters are processes of their own, which a
profiler of the pytest process alone does not see. ``report`` joins the two: per phase the wall time, the
CPU-seconds of the whole machine, how busy its cores were, and the idle wall time (wall minus CPU / cores),
where a test waits rather than works. Run it with nothing else on the machine: every process counts.
"""

from __future__ import annotations

import bisect
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")  # /proc/stat counts in these ticks (Linux only, as /proc is)


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / HZ  # all but idle and iowait


def run(out: Path, pytest_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HYMT_TIMELINE=str(out / "phases.jsonl"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "suite_timeline", *pytest_args], env=env)
    with open(out / "cpu.jsonl", "w") as cpu:
        last = _busy_seconds()
        while proc.poll() is None:
            time.sleep(1.0)
            now = _busy_seconds()
            cpu.write(json.dumps({"t": time.time(), "busy": round(now - last, 2)}) + "\n")
            cpu.flush()
            last = now
    return proc.returncode


def report(out: Path, by_file: bool) -> None:
    samples = [json.loads(line) for line in (out / "cpu.jsonl").read_text().splitlines()]
    phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    times, cores = [s["t"] for s in samples], os.cpu_count() or 1
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for p in phases:
        # A sample covers the second before it: the samples taken inside the phase.
        first, last = bisect.bisect_left(times, p["start"]), bisect.bisect_right(times, p["stop"])
        key = p["id"].split("::")[0] if by_file else f"{p['when']:8s} {p['id']}"
        rows[key][0] += p["stop"] - p["start"]
        rows[key][1] += sum(s["busy"] for s in samples[first:last])
    wall = samples[-1]["t"] - samples[0]["t"] + 1 if samples else 0.0
    print(f"{wall:.0f} s wall, {sum(s['busy'] for s in samples):.0f} CPU-s, {cores} cores")
    print(" wall s   CPU-s  busy  idle s  phase" if not by_file else " wall s   CPU-s  busy  idle s  file")
    for key, (seconds, cpu) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        if seconds >= 1.0:
            print(f"{seconds:7.1f} {cpu:7.1f} {100 * cpu / cores / seconds:4.0f}% {seconds - cpu / cores:7.1f}  {key}")


def pytest_runtest_logreport(report):  # the plugin side, in the pytest process
    with open(os.environ["HYMT_TIMELINE"], "a") as f:
        f.write(json.dumps({"id": report.nodeid, "when": report.when, "start": report.start,
                            "stop": report.stop, "outcome": report.outcome}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("run", "report"):
        sys.exit(__doc__)
    if sys.argv[1] == "run":
        sys.exit(run(Path(sys.argv[2]), sys.argv[3:]))
    report(Path(sys.argv[2]), "--files" in sys.argv[3:])
