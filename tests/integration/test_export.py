"""``hymt export`` on one machine: the finished e2e run's folder exported in the command's own process, with
no Ray started, to the very weights its checkpoint holds and the workers exported. The export in a Ray task,
kept for clusters (RAY_ADDRESS), is tests/integration/test_real_model_path.py's
``test_hymt_export_streams_a_stored_checkpoint_in_a_ray_task``, compared with the same workers' export. The
refusals before anything starts are tests/unit/test_commands_without_ray.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from test_mistakes import hymt

pytestmark = pytest.mark.integration


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_export_of_a_run_folder_runs_in_process_without_ray(finished_run, tmp_path):
    """From outside, as a user runs it: RAY_ADDRESS unset, HOME, TMPDIR and RAY_TMPDIR in tmp_path/home, so a
    Ray the command started would leave its folder there."""
    from transformers import AutoModelForCausalLM

    from raytrain_hymt.train.checkpoint import read_state
    from raytrain_hymt.train.export import _checkpoint_tensors

    storage, summary = finished_run
    out = tmp_path / "model"
    run = hymt(tmp_path, "export", str(storage / "e2e"), str(out))
    home = tmp_path / "home"
    assert run.returncode == 0, run.stderr[-3000:]
    # The run folder stands for its newest whole checkpoint.
    assert re.fullmatch(rf"exported {re.escape(summary.checkpoint)} to {re.escape(str(out))}  \(AutoModelForCausalLM"
                        r"\.from_pretrained loads it; peak memory of the export process [\d.]+ GiB\)\n", run.stdout)
    assert not (home / "ray").exists(), sorted(p.name for p in home.iterdir())

    # Byte for byte the checkpoint's fp32 weights (what DeepSpeed's zero_to_fp32 gives), and the same model
    # the workers exported at the end of the run.
    state = read_state(summary.checkpoint)
    stored = dict(_checkpoint_tensors(Path(summary.checkpoint), state.tag, state.zero_stage))
    mine = _tensors(out)
    assert mine.keys() == stored.keys()
    assert all(mine[k].dtype == stored[k].dtype == torch.float32 and torch.equal(mine[k], stored[k]) for k in mine)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    workers = AutoModelForCausalLM.from_pretrained(summary.model_dir, dtype=torch.float32).state_dict()
    assert loaded.keys() == workers.keys()
    assert all(torch.equal(loaded[k], workers[k]) for k in loaded)
