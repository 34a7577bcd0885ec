"""Where the test suite's time goes: each test phase's wall time beside the CPU the whole machine spent in it.

    python scripts/suite_timeline.py run OUT_DIR [pytest args ...]   # the suite, sampled (writes OUT_DIR)
    python scripts/suite_timeline.py report OUT_DIR [--files]        # phases (or files), longest first
    python scripts/suite_timeline.py report OUT_DIR --processes      # CPU by kind of process
    python scripts/suite_timeline.py report OUT_DIR --fits           # Ray Train fits per test

``run`` starts pytest with this file as a plugin, which appends each phase's start and stop to
``OUT_DIR/phases.jsonl``. Meanwhile, every second, this process reads the machine's busy CPU time from
``/proc/stat`` into ``OUT_DIR/cpu.jsonl`` and every process's CPU time from ``/proc/PID/stat`` into
``OUT_DIR/processes.json``. Ray's workers, actors and clusters are processes of their own, which a
profiler of the pytest process alone does not see.

``report`` joins phases and samples: per phase the wall time, the CPU-seconds of the whole machine, how
busy its cores were, and the idle wall time (wall minus CPU / cores), where a test waits rather than
works. ``report --processes`` sums the CPU by kind of process and says what share of the machine's CPU
the processes it saw account for: a process's last second before it ends is not seen, nor a process
that lives less than a second. ``report --fits`` gives each test the Ray Train controllers (one per fit)
and training workers that started during its phases, with their CPU. Run it with nothing else on the
machine: every process counts.
"""

from __future__ import annotations

import bisect
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HZ = os.sysconf("SC_CLK_TCK")  # /proc/stat counts in these ticks (Linux only, as /proc is)
FIT_KINDS = {"ray::TrainController": 0, "ray::RayTrainWorker": 1}  # one controller per fit; its workers


def _boot_time() -> float:
    """When the machine booted (epoch seconds): processes' start times count ticks from it."""
    with open("/proc/stat") as f:
        return float(next(line.split()[1] for line in f if line.startswith("btime")))


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / HZ  # all but idle and iowait


def _processes(seen: dict[str, dict]) -> None:
    """Update ``seen`` (keyed by pid and start time) with every process's CPU-seconds so far and its name."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        comm, fields = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
        name = comm
        if not comm or comm.startswith(("python", "pytest", "ray::")):  # the name is cut at 15 characters
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    argv = f.read().split("\0")
            except OSError:
                continue
            # Ray's workers title themselves "ray::Class.method", "ray::MapWorker(MapBatches(Fn))", "ray::IDLE";
            # a process that has ended but is not yet reaped has no command line (keep the name it had)
            name = argv[0].strip().split(".")[0] if argv[0].startswith("ray::") else argv[0] and _command_kind(argv)
        # fields[11], [12]: user and system ticks; [19]: start time in ticks after boot
        entry = seen.setdefault(f"{pid}@{fields[19]}", {"name": name or comm or "?"})
        entry["cpu"] = (int(fields[11]) + int(fields[12])) / HZ
        if name and name != "ray::IDLE":  # a task worker goes back to IDLE between tasks: keep what it ran
            entry["name"] = name


def _command_kind(argv: list[str]) -> str:
    """``python -m pytest ...`` -> ``python -m pytest``; ``python .../log_monitor.py ...`` -> ``python log_monitor.py``."""
    for i, arg in enumerate(argv[1:], 1):
        if arg == "-m" and i + 1 < len(argv):
            return f"python -m {argv[i + 1]}"
        if arg.endswith(".py"):
            return f"python {Path(arg).name}"
        if arg == "-c":
            return "python -c"
    return "python"


def run(out: Path, pytest_args: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "btime").write_text(f"{_boot_time():.0f}\n")
    env = dict(os.environ, HYMT_TIMELINE=str(out / "phases.jsonl"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "suite_timeline", *pytest_args], env=env)
    already: dict[str, dict] = {}
    _processes(already)
    seen: dict[str, dict] = {}
    with open(out / "cpu.jsonl", "w") as cpu:
        last = _busy_seconds()
        while proc.poll() is None:
            time.sleep(1.0)
            now = _busy_seconds()
            cpu.write(json.dumps({"t": time.time(), "busy": round(now - last, 2)}) + "\n")
            cpu.flush()
            last = now
            _processes(seen)
    # Processes that ran before the suite (this one among them) count only with what they spent during it.
    for key, before in already.items():
        if key in seen:
            seen[key]["cpu"] -= before["cpu"]
    (out / "processes.json").write_text(json.dumps(seen))
    return proc.returncode


def _records(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def report(out: Path, by_file: bool) -> None:
    samples = _records(out, "cpu.jsonl")
    phases = _records(out, "phases.jsonl")
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


def report_processes(out: Path) -> None:
    """CPU-seconds by kind of process (Ray's actors by their class, Python by script or module), most first."""
    samples = _records(out, "cpu.jsonl")
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for p in json.loads((out / "processes.json").read_text()).values():
        kinds[p["name"]][0] += p["cpu"]
        kinds[p["name"]][1] += 1
    machine, counted = sum(s["busy"] for s in samples), sum(cpu for cpu, _ in kinds.values())
    print(f"{machine:.0f} CPU-s on the machine; the processes seen account for {counted:.0f} ({100 * counted / machine:.0f}%)")
    print("  CPU-s  share  processes  CPU-s each  kind")
    for name, (cpu, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0]):
        if cpu >= 1.0:
            print(f"{cpu:7.1f} {100 * cpu / machine:5.1f}% {n:10d} {cpu / n:11.1f}  {name}")


def report_fits(out: Path) -> None:
    """Per test, the Ray Train fits (controllers) and workers that started during its phases, and their CPU."""
    if not (out / "btime").exists():  # runs recorded before `run` wrote it
        sys.exit(f"{out / 'btime'} is missing: write the boot time of the machine that ran the suite "
                 "(`btime` in its /proc/stat) there")
    btime = float((out / "btime").read_text())
    phases = _records(out, "phases.jsonl")
    starts = [p["start"] for p in phases]
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for key, p in json.loads((out / "processes.json").read_text()).items():
        kind = FIT_KINDS.get(p["name"])
        if kind is None:
            continue
        started = btime + int(key.split("@")[1]) / HZ
        i = bisect.bisect_right(starts, started) - 1
        test = phases[i]["id"] if i >= 0 and started <= phases[i]["stop"] else "(between tests)"
        rows[test][kind] += 1
        rows[test][2] += p["cpu"]
    print(" fits  workers   CPU-s  test")
    for test, (fits, workers, cpu) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"{fits:5d} {workers:8d} {cpu:7.1f}  {test}")
    print(f"{sum(r[0] for r in rows.values()):5d} {sum(r[1] for r in rows.values()):8d} "
          f"{sum(r[2] for r in rows.values()):7.1f}  in all")


def pytest_runtest_logreport(report):  # the plugin side, in the pytest process
    with open(os.environ["HYMT_TIMELINE"], "a") as f:
        f.write(json.dumps({"id": report.nodeid, "when": report.when, "start": report.start,
                            "stop": report.stop, "outcome": report.outcome}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("run", "report"):
        sys.exit(__doc__)
    if sys.argv[1] == "run":
        sys.exit(run(Path(sys.argv[2]), sys.argv[3:]))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # a report piped to `head` ends quietly
    if "--processes" in sys.argv[3:]:
        report_processes(Path(sys.argv[2]))
    elif "--fits" in sys.argv[3:]:
        report_fits(Path(sys.argv[2]))
    else:
        report(Path(sys.argv[2]), "--files" in sys.argv[3:])
