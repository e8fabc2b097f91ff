"""The files in cluster/, parsed and checked against what their tools expect,
without starting a cluster.

- ``ray-cluster.yaml``: Ray's own launcher schema and checks (what ``ray up``
  runs before it touches the cloud), and what rayspec needs of the nodes: the
  venv made by ``install_node.sh`` is the one that starts Ray, the dashboard
  listens on loopback, the object store is sized, the head runs the autoscaler.
- ``rayjob.yaml``: KubeRay ``RayJob`` fields (names from KubeRay's ray.io/v1
  types), an entrypoint that rayspec's config loader accepts, a Ray version
  matching the installed one, and pods the job's placement plan fits on.
- ``runtime_env.yaml`` (and the RayJob's runtimeEnvYAML): Ray's runtime_env
  validation, what the excludes leave out, and the merge with the driver's
  own ``ray.init`` runtime_env, which Ray refuses on a conflict.
- ``install_node.sh``: shell syntax, and an unknown flavor refused before
  anything is created.
"""

from __future__ import annotations

import configparser
import copy
import os
import re
import shlex
import subprocess
import types
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray._private.runtime_env.packaging import _get_excludes
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.runtime_env import RuntimeEnv
from ray.runtime_env.runtime_env import _merge_runtime_env

from rayspec.config import load_config
from rayspec.scheduler.placement import ClusterFitError, NodeInfo, plan_placement

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"

# json names of KubeRay's ray.io/v1 RayJobSpec and RayClusterSpec
# (ray-operator/apis/ray/v1/rayjob_types.go, raycluster_types.go)
RAYJOB_SPEC_FIELDS = {
    "activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate",
    "metadata", "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy",
    "entrypoint", "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources",
    "entrypointNumCpus", "entrypointNumGpus", "ttlSecondsAfterFinished",
    "shutdownAfterJobFinishes", "suspend", "schedule",
}
RAYCLUSTER_SPEC_FIELDS = {
    "headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
    "autoscalerOptions", "headServiceAnnotations", "suspend",
}


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _ray_start_flags(commands: list[str]) -> dict[str, str]:
    """``--key=value`` / ``--flag`` arguments of the ``ray start`` in a command list."""
    starts = [part for cmd in commands for part in cmd.split(";") if "/bin/ray start" in part]
    assert len(starts) == 1, commands
    flags = {}
    for arg in shlex.split(starts[0]):
        if arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            flags[key] = value
    return flags


def _driver_runtime_env(monkeypatch) -> dict:
    """The runtime_env rayspec's driver passes to ray.init when it joins a cluster."""
    from rayspec import driver

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    # ray.init returns the session's RayContext (its address_info: where the session's logs are)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw) or types.SimpleNamespace(address_info={}))
    driver.init_ray(load_config(None, ["ray.address=auto"]))
    return seen["runtime_env"]


# -- ray-cluster.yaml ------------------------------------------------------------

def test_launcher_config_passes_rays_checks():
    config = _load("ray-cluster.yaml")
    validate_config(prepare_config(copy.deepcopy(config)))
    assert config["provider"]["type"] == "aws"
    workers = [t for name, t in config["available_node_types"].items()
               if name != config["head_node_type"]]
    # the placement plan sees only live nodes: GPU workers must not start at zero
    assert workers and all(t.get("min_workers", 0) >= 1 for t in workers)


@pytest.mark.parametrize("breakage", [
    lambda c: c["available_node_types"]["gpu_worker"].pop("node_config"),
    lambda c: c.update(setup_command=c["setup_commands"]),  # misspelt key
    lambda c: c.update(head_node_type="missing"),
    lambda c: c.update(max_workers=0),  # below the sum of min_workers
])
def test_launcher_checks_reject_broken_configs(breakage):
    config = _load("ray-cluster.yaml")
    breakage(config)
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        validate_config(prepare_config(config))


def test_launcher_installs_with_install_node_sh_into_the_venv_that_runs_ray():
    config = _load("ray-cluster.yaml")
    mounts = {str(Path(r)): str(Path(local)) for r, local in config["file_mounts"].items()}
    for local in mounts.values():
        assert (ROOT / local).exists(), local
    # what `pip install -e <repo>` reads, and the code the jobs run
    readme = _setup_cfg()["metadata"]["long_description"].removeprefix("file:").strip()
    needed = {"setup.cfg", "pyproject.toml", readme, "rayspec", "jobs", "cluster"}
    assert needed <= set(mounts.values())

    installs = [m for cmd in config["setup_commands"]
                if (m := re.search(r"RAYSPEC_VENV=(\S+) bash (\S+) (\S+)", cmd))]
    assert len(installs) == 1, config["setup_commands"]
    venv, script, flavor = installs[0].groups()
    assert flavor == "cuda"
    remote = Path(script)
    mount = max((Path(r) for r in mounts if remote.is_relative_to(Path(r))), key=lambda p: len(p.parts))
    local = ROOT / mounts[str(mount)] / remote.relative_to(mount)
    assert local.resolve() == (CLUSTER / "install_node.sh").resolve()

    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        rays = re.findall(r"(\S*?)ray (?:start|stop)\b", " ".join(config[key]))
        assert rays and set(rays) == {f"{venv}/bin/"}, (key, rays)


def test_launcher_dashboard_on_loopback_and_object_store_sized():
    config = _load("ray-cluster.yaml")
    head = _ray_start_flags(config["head_start_ray_commands"])
    worker = _ray_start_flags(config["worker_start_ray_commands"])
    assert "head" in head and "head" not in worker
    assert head["dashboard-host"] == "127.0.0.1"
    # without it the head runs no autoscaler and no worker is ever launched
    assert head["autoscaling-config"] == "~/ray_bootstrap_config.yaml"
    assert worker["address"] == "$RAY_HEAD_IP:6379"
    for flags in (head, worker):
        assert int(flags["object-store-memory"]) >= 1 << 30
    assert "0.0.0.0" not in (CLUSTER / "ray-cluster.yaml").read_text()


# -- rayjob.yaml -------------------------------------------------------------------

def _quantity(q) -> float:
    """A Kubernetes CPU / GPU quantity ("24", "500m", 4) as a number."""
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _rayjob_run(job: dict) -> tuple[Path, list[str]]:
    """Preset and overrides of the ``python -m jobs.grpo`` in the entrypoint."""
    argv = shlex.split(job["spec"]["entrypoint"])
    steps, cur = [], []
    for arg in argv + ["&&"]:
        if arg == "&&":
            steps.append(cur)
            cur = []
        else:
            cur.append(arg)
    runs = [s for s in steps if s[:3] == ["python", "-m", "jobs.grpo"]]
    assert len(runs) == 1, argv
    preset, *overrides = runs[0][3:]
    assert preset.endswith(".yaml")
    return ROOT / preset, overrides


def _rayjob_nodes(job: dict, drop_workers: int = 0) -> list[NodeInfo]:
    """The Ray nodes the manifest's pods become (CPUs: num-cpus or the limit)."""
    spec = job["spec"]["rayClusterSpec"]
    groups = [(spec["headGroupSpec"], 1)] + [(g, g["replicas"]) for g in spec["workerGroupSpecs"]]
    nodes = []
    for group, count in groups:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        cpus = _quantity(group["rayStartParams"].get("num-cpus", limits["cpu"]))
        gpus = _quantity(limits.get("nvidia.com/gpu", 0))
        for _ in range(count):
            nodes.append(NodeInfo(f"node{len(nodes):02d}", cpus, gpus, cores=tuple(range(int(cpus)))))
    return nodes[:len(nodes) - drop_workers]


def test_rayjob_has_the_fields_kuberay_expects():
    job = _load("rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"])
    spec = job["spec"]
    assert set(spec) <= RAYJOB_SPEC_FIELDS, set(spec) - RAYJOB_SPEC_FIELDS
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    cluster = spec["rayClusterSpec"]
    assert set(cluster) <= RAYCLUSTER_SPEC_FIELDS, set(cluster) - RAYCLUSTER_SPEC_FIELDS
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        # map[string]string in the CRD: an unquoted number is rejected
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        container = group["template"]["spec"]["containers"][0]
        assert container["image"] and container["resources"]["limits"]["cpu"]
    for group in cluster["workerGroupSpecs"]:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert _quantity(limits["nvidia.com/gpu"]) >= 1


def test_rayjob_ray_version_and_images_match_the_installed_ray():
    cluster = _load("rayjob.yaml")["spec"]["rayClusterSpec"]
    version = cluster["rayVersion"]
    assert version.split(".")[:2] == ray.__version__.split(".")[:2]
    min_py = tuple(int(x) for x in _setup_cfg()["options"]["python_requires"]
                   .removeprefix(">=").split("."))
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        image = group["template"]["spec"]["containers"][0]["image"]
        m = re.fullmatch(rf"rayproject/ray:{re.escape(version)}-py3(\d+)(-\w+)?", image)
        assert m, image
        assert (3, int(m.group(1))) >= min_py


def test_rayjob_entrypoint_is_a_run_config_the_loader_accepts():
    job = _load("rayjob.yaml")
    preset, overrides = _rayjob_run(job)
    assert preset.is_file() and preset.parent == ROOT / "jobs" / "configs"
    cfg = load_config(preset, overrides)
    assert cfg.data.path == "openai/gsm8k"  # the pods have no ../shared copy
    # the driver writes the model and the run where every pod reads them
    spec = job["spec"]["rayClusterSpec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    shared = set.intersection(*({m["mountPath"] for m in g["template"]["spec"]["containers"][0]
                                 ["volumeMounts"]} for g in groups))
    for path in (cfg.trainer.run_dir, cfg.model.cache_dir):
        assert any(Path(path).is_relative_to(m) for m in shared), path


def test_rayjob_pods_host_the_jobs_placement_plan():
    job = _load("rayjob.yaml")
    cfg = load_config(*_rayjob_run(job))
    plan_placement(cfg, _rayjob_nodes(job))
    with pytest.raises(ClusterFitError):
        plan_placement(cfg, _rayjob_nodes(job, drop_workers=1))


def test_rayjob_runtime_env_ships_and_installs_the_same_code():
    env = yaml.safe_load(_load("rayjob.yaml")["spec"]["runtimeEnvYAML"])
    RuntimeEnv(**env)
    # the submitter pod has no checkout: the code must be a URL the pods fetch
    url = env["working_dir"]
    assert re.fullmatch(r"(https|s3|gs)://\S+\.zip", url), url
    extras = _setup_cfg()["options.extras_require"]
    assert f"rayspec[cuda] @ {url}" in env["pip"]["packages"] and "cuda" in extras


# -- runtime_env.yaml (and the RayJob's) -------------------------------------------

@pytest.fixture(params=["runtime_env.yaml", "rayjob.yaml"])
def runtime_env(request) -> dict:
    d = _load(request.param)
    return yaml.safe_load(d["spec"]["runtimeEnvYAML"]) if request.param == "rayjob.yaml" else d


def test_runtime_env_is_valid_and_merges_with_the_drivers(runtime_env, monkeypatch):
    RuntimeEnv(**runtime_env)  # type checks of the known fields
    assert set(runtime_env) <= RuntimeEnv.known_fields, set(runtime_env) - RuntimeEnv.known_fields
    assert _merge_runtime_env(runtime_env, _driver_runtime_env(monkeypatch)) is not None


def test_runtime_env_working_dir_leaves_out_venv_and_outputs_not_code():
    env = _load("runtime_env.yaml")
    assert env["working_dir"] == "."
    excluded = _get_excludes(ROOT, env["excludes"])
    for path in (".venv", ".venv/bin/python", ".git", "runs/gsm8k", "rayspec/__pycache__"):
        assert excluded(ROOT / path), path
    for path in ("rayspec/config.py", "jobs/grpo.py", "jobs/configs/gsm8k.yaml", "setup.cfg"):
        assert not excluded(ROOT / path), path


# -- install_node.sh -----------------------------------------------------------------

def test_install_node_sh_parses():
    subprocess.run(["bash", "-n", str(CLUSTER / "install_node.sh")], check=True)


def test_install_node_sh_refuses_unknown_flavor_before_creating_anything(tmp_path):
    venv = tmp_path / "venv"
    r = subprocess.run(["bash", str(CLUSTER / "install_node.sh"), "bogus"],
                       env={**os.environ, "RAYSPEC_VENV": str(venv)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "unknown flavor 'bogus'" in r.stderr
    assert not venv.exists()
