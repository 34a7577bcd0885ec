"""``cluster.yaml`` (``ray up``) against Ray's own autoscaler schema, and the rules the schema cannot see.

Ray's ``prepare_config`` + ``validate_config`` work offline and reject unknown or mistyped keys, but
never look inside ``node_config`` (that is passed to EC2 as is): the instance types are checked against
AWS's published GPU shapes and the presets' "Hardware:" notes here instead. ``ray up`` itself needs an
AWS account and was not run.
"""

from __future__ import annotations

import copy
import math
import re
import tomllib

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from conftest import REPO
from raytrain_hymt.config.schema import PRESETS

CLUSTER = REPO / "cluster.yaml"
#: AWS's published shapes (aws.amazon.com/ec2/instance-types): GPU model as the presets name it, GPUs per node.
AWS_GPUS = {"p5.48xlarge": ("H100", 8), "p5en.48xlarge": ("H200", 8), "p4de.24xlarge": ("A100-80GB", 8)}
AWS_CPU_ONLY = {"m6i.4xlarge"}


def _validate(config: dict) -> None:
    validate_config(prepare_config(copy.deepcopy(config)))


def test_cluster_yaml_passes_rays_autoscaler_schema():
    _validate(yaml.safe_load(CLUSTER.read_text()))


@pytest.mark.parametrize("breakage", [
    lambda c: c.update(idle_timout_minutes=c.pop("idle_timeout_minutes")),  # a misspelt key
    lambda c: c["available_node_types"]["gpu_worker"].update(min_worker=1),
    lambda c: c.update(max_workers="four"),
    lambda c: c["docker"].update(run_option=c["docker"].pop("run_options")),
])
def test_the_schema_check_fails_on_a_broken_copy(breakage):
    config = yaml.safe_load(CLUSTER.read_text())
    breakage(config)
    with pytest.raises(jsonschema.ValidationError):
        _validate(config)


def test_image_tag_is_the_pinned_ray_version():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pinned,) = [re.fullmatch(r"ray\[[^\]]*\]==(\S+)", d)[1] for d in deps if d.startswith("ray[")]
    assert yaml.safe_load(CLUSTER.read_text())["docker"]["image"] == f"rayproject/ray:{pinned}-py311-gpu"


def test_nothing_listens_on_all_interfaces_and_every_node_uses_token_auth():
    text = CLUSTER.read_text()
    assert "0.0.0.0" not in text
    config = yaml.safe_load(text)
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "--dashboard-host=127.0.0.1" in head_start  # reached through `ray dashboard cluster.yaml`
    for command in [head_start] + [c for c in config["worker_start_ray_commands"] if "ray start" in c]:
        assert command.startswith("ulimit -n 65536; RAY_AUTH_MODE=token ray start"), command
    assert any("SecretId='hymt/ray-auth-token'" in c and "> ~/.ray/auth_token" in c for c in config["setup_commands"])


def test_no_token_or_key_in_the_file():
    text = CLUSTER.read_text()
    config = yaml.safe_load(text)
    assert "ssh_private_key" not in config["auth"]
    leaks = {
        "AWS access key id": r"\b(AKIA|ASIA)[0-9A-Z]{16}\b",
        "private key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
        "token or secret assigned": r"(?i)(RAY_AUTH_TOKEN|aws_secret_access_key|aws_session_token)\s*[=:]",
        "long hex/base64 value (a generated token)": r"\b[0-9a-fA-F]{32,}\b|[A-Za-z0-9+/]{40,}={0,2}",
    }
    for what, pattern in leaks.items():
        assert not re.search(pattern, text), f"cluster.yaml holds a {what}"
    for node_type in config["available_node_types"].values():
        assert set(node_type["node_config"]["IamInstanceProfile"]) == {"Name"}  # a role by reference


def _hardware_note(preset: str) -> str:
    """The "Hardware:" part of a preset's leading comment block."""
    lines = (PRESETS / f"{preset}.yaml").read_text().splitlines()
    comments = " ".join(line.lstrip("# ") for line in lines[: next(i for i, ln in enumerate(lines) if not ln.startswith("#"))])
    return comments[comments.index("Hardware:"):]


def _gpu_counts(note: str) -> tuple[float, float]:
    """``"4–8 GPUs"`` → (4, 8); ``"2 or more H200"`` → (2, inf)."""
    if m := re.search(r"(\d+)[–-](\d+) (?:× )?(?:GPUs|\w+ GPUs)", note):
        return int(m[1]), int(m[2])
    m = re.search(r"(\d+) or more", note)
    return int(m[1]), math.inf


def test_instance_types_match_the_presets_hardware_notes():
    """Every instance type in the file (active or in a comment) is a known shape; each GPU one names presets
    (``presets:`` comment before it) whose hardware note names its GPU and allows its GPU count."""
    presets: list[str] = []
    seen = []
    for line in CLUSTER.read_text().splitlines():
        if m := re.search(r"presets: ([\w\-, ]+)", line):
            presets = [p.strip() for p in m[1].split(",")]
        if m := re.search(r"InstanceType: (\S+)", line):
            itype = m[1]
            seen.append(itype)
            if itype in AWS_CPU_ONLY:
                continue
            assert itype in AWS_GPUS, f"{itype}: not a known GPU shape; add it to AWS_GPUS with its GPU"
            gpu, count = AWS_GPUS[itype]
            assert presets, f"{itype}: no '# presets:' comment before it"
            for preset in presets:
                note = _hardware_note(preset)
                assert gpu in note, f"{itype} has {gpu}, which {preset}'s hardware note does not name: {note}"
                low, high = _gpu_counts(note)
                assert low <= count <= high, f"{itype} has {count} GPUs; {preset} is for {low}-{high}"
    config = yaml.safe_load(CLUSTER.read_text())
    assert config["available_node_types"]["head"]["node_config"]["InstanceType"] in AWS_CPU_ONLY
    assert config["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"] == "p5.48xlarge"
    assert {"p4de.24xlarge", "p5en.48xlarge"} <= set(seen)  # the alternatives in comments are checked too
