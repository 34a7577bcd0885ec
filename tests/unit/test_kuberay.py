"""``jobs/kuberay/rayjob.yaml``: the RayJob's fields, its pod templates against Kubernetes' own schemas.

``kubernetes-validate`` ships the OpenAPI schemas of each Kubernetes release, so this runs offline; it
knows core objects only, so each embedded pod template is wrapped in a v1 ``PodTemplate``. Applying the
RayJob needs a Kubernetes cluster with KubeRay, which this machine has not: it was not run.
"""

from __future__ import annotations

import copy
import re
import shlex

import kubernetes_validate
import pytest
import yaml

from conftest import REPO
from raytrain_hymt.config.schema import load_config

RAYJOB = REPO / "jobs" / "kuberay" / "rayjob.yaml"
K8S_VERSION = "1.33"


def _rayjob() -> dict:
    return yaml.safe_load(RAYJOB.read_text())


def _pod_templates(job: dict) -> dict[str, dict]:
    cluster = job["spec"]["rayClusterSpec"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return out


def _validate_pod_template(name: str, template: dict) -> None:
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
    kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def readme_entrypoint() -> str:
    """The command after ``--`` of the ``ray job submit`` block in the README's "Run on a cluster" section."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Run on a cluster"):]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "ray job submit" in b)
    joined = re.sub(r"\\\n\s*", " ", block)
    (submit,) = [line for line in joined.splitlines() if line.startswith("ray job submit")]
    return " ".join(submit.split(" -- ", 1)[1].split())


def test_rayjob_fields():
    job = _rayjob()
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    cluster = spec["rayClusterSpec"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["authOptions"] == {"mode": "token", "secretName": "hymt-ray-auth"}
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    (gpu_group,) = cluster["workerGroupSpecs"]
    (worker,) = gpu_group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == "8"  # extended resources: requests = limits
    assert 1 <= gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    for container in (head, worker):  # bucket credentials from a Secret, never a literal
        assert container["envFrom"] == [{"secretRef": {"name": "hymt-bucket"}}]
        assert "env" not in container
    data = yaml.safe_dump(job)  # the comments show the kubectl commands that create the Secrets
    assert not re.search(r"(?i)aws_secret_access_key|auth_token|RAY_AUTH_TOKEN", data)


def test_entrypoint_is_the_readmes_and_a_valid_job():
    entrypoint = " ".join(_rayjob()["spec"]["entrypoint"].split())
    assert entrypoint == readme_entrypoint()
    argv = shlex.split(entrypoint)
    assert argv[:4] == ["python", "jobs/train.py", "--config", "hy-mt-7b-zero3"]
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    cfg = load_config(argv[3], overrides)
    gpus = 8 * _rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"]
    assert cfg.scaling.use_gpu and cfg.scaling.num_workers == gpus  # one worker per GPU of the started nodes


def test_pod_templates_pass_the_kubernetes_schema():
    for name, template in _pod_templates(_rayjob()).items():
        _validate_pod_template(name, template)


@pytest.mark.parametrize("breakage", [
    lambda t: t["spec"]["containers"][0]["resources"].update(limit={"cpu": "1"}),  # unknown field
    lambda t: t["spec"]["containers"][0].update(ports=[{"containerPort": "6379"}]),  # a string for an int
    lambda t: t["spec"].update(volumes=[{"emptyDir": {}}]),  # a volume without its required name
])
def test_the_schema_check_fails_on_a_broken_template(breakage):
    template = copy.deepcopy(_pod_templates(_rayjob())["head"])
    breakage(template)
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_pod_template("head", template)
