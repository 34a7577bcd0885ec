"""A quiet console: the default job's output holds the project's lines and progress, none of Ray's or
DeepSpeed's internals; the driver's progress display fed by rank 0 (a real named actor on the session Ray)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

from conftest import REPO

NOISE = re.compile(r"TrainingReport\(|real_accelerator\.py|\w+Warning:|Traceback")
#: A line of Ray's C++ core (e.g. ``[2026-12-01 13:05:43,934 E 29096 29096] core_worker.cc:2465: Actor with
#: class name: ...``), which Ray writes to the driver's stderr itself, past every Python setting.
RAY_CORE_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [DIWEF] \d+ \d+\] \w+\.cc:\d+:", re.MULTILINE)
#: What Ray Data's own bars print (tqdm on a terminal, log lines without one).
RAY_DATA_BAR = re.compile(r"Running Dataset|Dataset \w+ execution finished in")


def assert_quiet_console(console: str, steps: int) -> None:
    """``console`` (the default job's output, shortened to ``steps`` steps with validation every 3) holds
    no internal line, and rank 0's progress as lines (no terminal; a run this short prints every step)."""
    assert [line for line in console.splitlines() if NOISE.search(line)] == []
    assert RAY_CORE_LINE.findall(console) == []
    assert "Loading checkpoint shards" not in console and "Reporting training result" not in console
    lines = [line for line in console.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in lines] == [f"{n}/{steps}" for n in range(1, steps + 1)]
    assert re.fullmatch(rf"step 3/{steps} loss \d\.\d{{4}} val \d\.\d{{4}} lr 1\.20e-03 \d+ tok/s/worker", lines[2])


# The console of the default job is captured by tests/integration/test_job_submit.py (`ray job logs` of a submitted
# 6-step default job), which calls assert_quiet_console: no second job for the same check.


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_driver_shows_what_rank_0_publishes(ray_session):
    from raytrain_hymt.console.progress import Publisher, Watcher

    for stream in (io.StringIO(), _Terminal()):
        watcher = Watcher(stream=stream, poll_s=3600)  # polled by hand below
        rank0 = Publisher(watcher.name)
        for step in range(1, 7):
            rank0.step(step=step, total=6, loss=8.0 - step / 10, lr=1e-3, tokens_per_s=1000.0 + step,
                       console_every=3, val_loss=7.5 if step == 3 else None)
            ray_session.get(watcher.actor.read.remote(0))  # the update has landed
            watcher.poll()
        import logging

        rank1 = Publisher(watcher.name, rank=1)
        logging.getLogger("raytrain_hymt").warning("step 4: update skipped")  # both "ranks" of this process
        rank1.step(step=99, total=6, loss=0.0, lr=0.0, tokens_per_s=0.0)  # only rank 0 publishes steps
        rank1.close()
        rank0.close()
        watcher.close()
        text = stream.getvalue()
        assert "step 4: update skipped" in text and "rank 1: step 4: update skipped" in text
        # rank 1's step is never shown ("99" alone could be part of tqdm's rate, e.g. 1.99step/s)
        assert "99/6" not in text and "loss 0.0000" not in text
        if isinstance(stream, _Terminal):  # one bar redrawn in place: step/total, loss, tokens/s, ETA
            assert "6/6" in text and "loss 7.4000 1006 tok/s/worker" in text and "<00:00" in text
            assert "\n" not in text.split("step 4: update skipped")[0]
        else:  # every console_every steps, the first, the last and every validation
            assert [line.split()[1] for line in text.splitlines() if line.startswith("step ") and "/" in line.split()[1]] == [
                "1/6", "3/6", "6/6"]
            assert "step 3/6 loss 7.7000 val 7.5000 lr 1.00e-03 1003 tok/s/worker" in text
        assert _board_gone(ray_session, watcher.name)


def _board_gone(ray, name: str, timeout_s: float = 20.0) -> bool:
    """Whether the board actor ``name`` is gone within ``timeout_s``: ``ray.kill`` returns before the name
    is released (on a loaded machine the test saw it still registered right after close())."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace="hymt")
        except ValueError:
            return True
        time.sleep(0.1)
    return False


def test_verbose_brings_rays_output_back(monkeypatch):
    import logging

    from raytrain_hymt.console.quiet import ray_init_kwargs

    monkeypatch.delenv("HYMT_VERBOSE", raising=False)
    assert ray_init_kwargs() == {"log_to_driver": False, "logging_level": logging.ERROR}
    monkeypatch.setenv("HYMT_VERBOSE", "1")
    assert ray_init_kwargs() == {"log_to_driver": True, "logging_level": logging.INFO}


def _on_a_terminal(args: list[str], verbose: bool = False) -> str:
    """Everything ``python -m raytrain_hymt.cli ARGS`` writes to a pseudo-terminal of 120 columns (as
    users see it: tqdm and Ray Data decide on isatty), carriage returns kept."""
    import fcntl
    import pty
    import struct
    import termios

    env = {k: v for k, v in os.environ.items() if k not in ("HYMT_VERBOSE", "RAY_ADDRESS")}
    env.update({"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
                **({"HYMT_VERBOSE": "1"} if verbose else {})})
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "raytrain_hymt.cli", *args], stdin=child, stdout=child,
                            stderr=child, env=env, cwd=REPO, start_new_session=True)
    os.close(child)
    out = bytearray()
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: every writer of the terminal has closed it
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=600) == 0, out.decode(errors="replace")[-3000:]
    os.close(main)
    return out.decode(errors="replace")


#: The lines data preparation shows, in order (the bundled sample: 10390 pairs, 2 sort partitions), as
#: regular expressions; then the prepare's summary ("data: read ...").
PREPARE_LINES = [
    r"data: reading \d+\.\d MB of corpus files, tokenizing on \d+ actors, sorting into 2 partitions",
    r"data: 10390 pairs read, (?P<examples>\d+) examples kept and tokenized, in 2 sort partitions \(\d+ s\)",
    r"data: (?P<train_rows>\d+) training rows and (?P<val_rows>\d+) validation rows packed and written \(\d+ s\)",
    r"prepared dataset written to .* \(manifest [0-9a-f]{32}\)",
]


def assert_prepare_lines(lines: list[str]) -> None:
    """``lines`` hold the :data:`PREPARE_LINES` in order, each once, and their counts agree with the
    summary (kept examples = training + validation examples; the training rows)."""
    found = [[m for ln in lines if (m := re.fullmatch(rx, ln))] for rx in PREPARE_LINES]
    assert [len(f) for f in found] == [1] * len(PREPARE_LINES), lines
    positions = [lines.index(f[0].string) for f in found]
    assert positions == sorted(positions), lines
    summary = [ln for ln in lines if ln.startswith("data: read 10390 pairs; ")]
    assert len(summary) == 1 and summary[0].startswith(
        "data: read 10390 pairs; dropped length_ratio 15, too_many_tokens 2, unsupported_language 332; "), lines
    m = re.search(r"train (\d+) examples in (\d+) rows .*validation (\d+) examples", summary[0])
    assert int(found[1][0]["examples"]) == int(m[1]) + int(m[3])
    assert found[2][0]["train_rows"] == m[2] and int(found[2][0]["val_rows"]) > 0


def test_prepare_shows_its_stages_as_lines_and_verbose_brings_ray_datas_bars_back(tmp_path):
    """``hymt prepare`` on the bundled sample, on a terminal: one line a stage and nothing redrawn in
    place (no bar: neither Ray Data's nor one of the project's), no internal line (Ray's C++ line about the
    tokenizer pool's constructor arguments included). ``HYMT_VERBOSE=1``: Ray Data's bars are back."""
    console = _on_a_terminal(["prepare", str(tmp_path / "ds")])
    assert RAY_DATA_BAR.findall(console) == []
    assert RAY_CORE_LINE.findall(console) == [] and [ln for ln in console.splitlines() if NOISE.search(ln)] == []
    # The terminal ends every line with \r\n; a \r alone would be a bar redrawn over itself.
    assert re.findall(r"\r(?!\n)", console) == []
    assert_prepare_lines(console.splitlines())

    verbose = _on_a_terminal(["prepare", str(tmp_path / "ds-verbose")], verbose=True)
    assert "Running Dataset" in verbose
    assert_prepare_lines([ln.strip() for ln in re.split(r"[\r\n]+", verbose) if ln.strip()])


def test_prepare_logs_the_same_lines_without_a_terminal(ray_session, tmp_path, monkeypatch, caplog):
    """Without a terminal the same lines, each once, through the project's logger (which the console
    shows at default verbosity); the project adds no callback to Ray Data's executions."""
    import logging

    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.driver.train import prepare_dataset

    monkeypatch.delenv("HYMT_VERBOSE", raising=False)
    with caplog.at_level(logging.INFO, logger="raytrain_hymt"):
        stats = prepare_dataset(load_config(None, []), str(tmp_path / "ds"))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("raytrain_hymt")] + [stats.summary()]
    assert_prepare_lines(lines)
    callbacks = ray_session.data.DataContext.get_current().custom_execution_callback_classes
    assert [c for c in callbacks if c.__module__.startswith("raytrain_hymt")] == []
