"""Driver of the two-node test (tests/test_fault_tolerance.py), run in its own process with its own Ray.

``python tests/two_node_run.py STORAGE_URI OUT_JSON`` starts a two-node cluster on this machine
(``ray.cluster_utils.Cluster``: a head and a worker node, one logical CPU each, so the two training
workers land on different nodes), trains the 10-step run, removes the worker node (its raylet and
training worker die, SIGKILL) once step 5 is recorded, adds a fresh node a few seconds later, and writes
OUT_JSON: the summary (or error), the nodes used and the step after which the node was removed (a file:
the workers' log lines reach this process's stdout at any time). Its own process because the
test session already holds a local Ray (``ray_session``) and a process can be connected to only one.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_tolerance_common import overrides, read_records  # noqa: E402
from mlflow_server import free_port  # noqa: E402

KILL_AFTER_STEP = 5


def main(storage: str, out_json: str) -> None:
    from dataclasses import asdict

    import ray
    from ray.cluster_utils import Cluster

    import raytrain_hymt.storage as run_storage
    from raytrain_hymt.config import load_config
    from raytrain_hymt.quiet import quiet_ray
    from raytrain_hymt.trainer import run_training

    run_storage.STAGING_ROOT = Path(out_json).parent / "staging"  # keep the driver's local copies in the test's folder

    record_dir = os.environ["HYMT_RECORD_DIR"]
    node_args = {"num_cpus": 1, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "gcs_server_port": free_port()})
    worker = cluster.add_node(**node_args)
    try:
        quiet_ray()
        ray.init(address=cluster.address, log_to_driver=True)
        cfg = load_config(None, overrides(storage, "twonode", **{
            "checkpoint.async_upload": True, "run.export": True, "checkpoint.max_failures": 2}))
        outcome: dict = {}

        def train() -> None:
            try:
                outcome["summary"] = asdict(run_training(cfg))
            except Exception as e:  # noqa: BLE001 - reported to the test as data
                outcome["error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=train)
        thread.start()
        path = Path(record_dir, "rank0.jsonl")
        while thread.is_alive() and not (path.exists() and read_records(Path(record_dir), 0)[-1]["step"] >= KILL_AFTER_STEP):
            time.sleep(0.2)
        outcome["nodes_before"] = sorted({r["node"] for rank in (0, 1) for r in read_records(Path(record_dir), rank)})
        outcome["worker_node"] = worker.node_id
        cluster.remove_node(worker, allow_graceful=False)
        outcome["killed_after_step"] = read_records(Path(record_dir), 0)[-1]["step"]
        time.sleep(3)
        cluster.add_node(**node_args)  # the node "returns": the run needs two workers again
        thread.join(timeout=400)
        Path(out_json).write_text(json.dumps(outcome))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
