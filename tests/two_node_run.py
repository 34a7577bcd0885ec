"""A driver process for the loopback cluster's training tests (tests/integration/test_fault_tolerance.py).

``python tests/two_node_run.py ADDRESS STORAGE_URI NAME OUT_JSON [section.field=value ...]`` connects to
the Ray cluster at ADDRESS (the ``two_node_cluster`` fixture's GCS), trains the 10-step run NAME of
``fault_tolerance_common.overrides`` with the extra overrides, and writes OUT_JSON: the summary, or the
error. The test that starts it kills and restores the cluster's second node while it trains. Its own
process because the test session already holds a local Ray (``ray_session``) and a process can be
connected to only one.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_tolerance_common import overrides  # noqa: E402


def main(address: str, storage: str, name: str, out_json: str, *sets: str) -> None:
    import ray

    import raytrain_hymt.storage as run_storage
    from raytrain_hymt.config.schema import load_config
    from raytrain_hymt.console.quiet import quiet_ray
    from raytrain_hymt.driver.train import run_training

    run_storage.STAGING_ROOT = Path(out_json).parent / "staging"  # keep the driver's local copies in the test's folder
    quiet_ray()
    ray.init(address=address, log_to_driver=True)
    try:
        outcome = {"summary": asdict(run_training(load_config(None, [*overrides(storage, name), *sets])))}
    except Exception as e:  # noqa: BLE001 - reported to the test as data
        outcome = {"error": f"{type(e).__name__}: {e}"}
    finally:
        ray.shutdown()
    Path(out_json).write_text(json.dumps(outcome))


if __name__ == "__main__":
    main(*sys.argv[1:])
