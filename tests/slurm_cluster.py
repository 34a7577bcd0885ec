"""A one-machine Slurm cluster for a test: its own munged, slurmctld and slurmd, stopped afterwards.

Everything lives in one folder: the munge key and socket, a generated ``slurm.conf`` (``proctrack/linuxproc``
and ``task/none``: no cgroups needed; ports of its own), the daemons' state, spool, pid and log files. Client
commands (``sbatch``, ``squeue``, ``sacct``) find it through ``SLURM_CONF`` in the returned environment.
Needs root (slurmd starts job steps as the job's user) and Debian's ``slurm-wlm`` and ``munge`` packages.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from mlflow_server import _stop_group, free_port

NODE = "hymtnode"


def missing() -> str | None:
    """Why a Slurm cluster cannot start here, or None."""
    tools = [t for t in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol") if not shutil.which(t)]
    if tools:
        return f"not installed: {', '.join(tools)} (apt-get install slurm-wlm munge; .ci/run does)"
    if os.geteuid() != 0:
        return "slurmd must run as root"
    return None


def _conf(root: Path, cpus: int) -> str:
    return "\n".join([
        "ClusterName=hymttest", f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
        "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={root}/munge/munge.socket",
        f"StateSaveLocation={root}/ctld", f"SlurmdSpoolDir={root}/spool",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "ReturnToService=2", "SlurmdParameters=config_overrides",
        "PlugStackConfig=/dev/null",
        # Logical CPUs (config_overrides: more than the machine has, like Ray's logical CPUs in the tests).
        f"NodeName={NODE} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n"


@contextlib.contextmanager
def slurm_cluster(root: Path, cpus: int = 8):
    """Yield the environment for Slurm's client commands while munged, slurmctld and slurmd run."""
    for sub in ("munge", "ctld", "spool"):
        (root / sub).mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)  # munged refuses a key or socket folder others can write to
    subprocess.run(["mungekey", "--create", f"--keyfile={root}/munge/munge.key"], check=True, capture_output=True)
    conf = root / "slurm.conf"
    conf.write_text(_conf(root, cpus))
    env = dict(os.environ, SLURM_CONF=str(conf))
    daemons = []
    try:
        m = root / "munge"
        daemons.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
             f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        _wait(lambda: (m / "munge.socket").exists(), "munged", root / "munge" / "munged.log")
        for daemon in (["slurmctld", "-D", "-i", "-f", str(conf)], ["slurmd", "-D", "-N", NODE, "-f", str(conf)]):
            daemons.append(subprocess.Popen(daemon, env=env, start_new_session=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        _wait(lambda: _node_idle(env), "slurmd registering with slurmctld", root / "slurmd.log")
        yield env
    finally:
        for proc in reversed(daemons):
            _stop_group(proc, grace_s=15)


def _node_idle(env: dict) -> bool:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "idle"


def _wait(ready, what: str, log: Path, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not ready():
        if time.time() > deadline:
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            raise TimeoutError(f"{what}: not ready after {timeout_s} s; {log}:\n{tail}")
        time.sleep(0.5)
