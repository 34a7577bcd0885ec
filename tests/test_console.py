"""A quiet console: the default job's output holds the project's lines and progress, none of Ray's or
DeepSpeed's internals; the driver's progress display fed by rank 0 (a real named actor on the session Ray)."""

from __future__ import annotations

import io
import re
import time

NOISE = re.compile(r"TrainingReport\(|real_accelerator\.py|\w+Warning:|Traceback")


def assert_quiet_console(console: str, steps: int) -> None:
    """``console`` (the default job's output, shortened to ``steps`` steps with validation every 3) holds
    no internal line, and rank 0's progress as lines (no terminal; a run this short prints every step)."""
    assert [line for line in console.splitlines() if NOISE.search(line)] == []
    assert "Loading checkpoint shards" not in console and "Reporting training result" not in console
    lines = [line for line in console.splitlines() if line.startswith("step ")]
    assert [s.split()[1] for s in lines] == [f"{n}/{steps}" for n in range(1, steps + 1)]
    assert re.fullmatch(rf"step 3/{steps} loss \d\.\d{{4}} val \d\.\d{{4}} lr 1\.20e-03 \d+ tok/s/worker", lines[2])


# The console of the default job is captured by tests/test_job_submit.py (`ray job logs` of a submitted
# 6-step default job), which calls assert_quiet_console: no second job for the same check.


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_driver_shows_what_rank_0_publishes(ray_session):
    from raytrain_hymt.progress import Publisher, Watcher

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

    from raytrain_hymt.quiet import ray_init_kwargs

    monkeypatch.delenv("HYMT_VERBOSE", raising=False)
    assert ray_init_kwargs() == {"log_to_driver": False, "logging_level": logging.ERROR}
    monkeypatch.setenv("HYMT_VERBOSE", "1")
    assert ray_init_kwargs() == {"log_to_driver": True, "logging_level": logging.INFO}
