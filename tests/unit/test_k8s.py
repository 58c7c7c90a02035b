"""KubeRay manifests: valid against the CRD schemas, app args valid, job args parse, versions consistent."""

from __future__ import annotations

import json
import shlex
from importlib.metadata import version
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.config import ServeConfig

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "tests" / "data" / "k8s-schemas"  # KubeRay v1 CRD schemas (see its README)
MANIFESTS = {"raycluster.yaml": "raycluster-ray.io-v1.json", "rayservice.yaml": "rayservice-ray.io-v1.json",
             "rayjob.yaml": "rayjob-ray.io-v1.json"}


def load(name: str) -> dict:
    return yaml.safe_load((REPO / "k8s" / name).read_text())


def images(obj) -> list[str]:
    if isinstance(obj, dict):
        own = [obj["image"]] if isinstance(obj.get("image"), str) else []
        return own + [i for v in obj.values() for i in images(v)]
    if isinstance(obj, list):
        return [i for v in obj for i in images(v)]
    return []


@pytest.mark.parametrize("manifest,schema", list(MANIFESTS.items()))
def test_manifest_validates_against_crd_schema(manifest, schema):
    jsonschema.validate(load(manifest), json.loads((SCHEMAS / schema).read_text()))


def test_schema_check_catches_a_bad_manifest():
    bad = load("raycluster.yaml")
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, json.loads((SCHEMAS / MANIFESTS["raycluster.yaml"]).read_text()))


def test_serve_config_v2_is_a_valid_app_config():
    spec = yaml.safe_load(load("rayservice.yaml")["spec"]["serveConfigV2"])
    app = spec["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    cfg = ServeConfig.model_validate(app["args"])
    assert cfg.tp_size >= 2 and cfg.draft and cfg.plan_store.startswith("s3://")
    assert cfg.tp_backend == "nccl" and cfg.num_gpus >= 1


def test_local_serve_config_is_valid():
    spec = yaml.safe_load((REPO / "deployments" / "config.yaml").read_text())
    ServeConfig.model_validate(spec["applications"][0]["args"])


def test_rayjob_entrypoint_parses_with_the_job_parser():
    from tuning.profile import parse_config

    argv = shlex.split(load("rayjob.yaml")["spec"]["entrypoint"])
    assert argv[:2] == ["python", "tuning/profile.py"]
    cfg, _ = parse_config(argv[2:])
    assert cfg.storage.startswith("s3://") and cfg.tp_size == 2
    job = load("rayjob.yaml")["spec"]
    assert job["shutdownAfterJobFinishes"] is True and job["ttlSecondsAfterFinished"] > 0


def test_a_profiling_trial_fits_one_node_of_every_gpu_group():
    """A trial with --tp-size N takes N + 1 GPUs (the draft and each rank): a group whose node has fewer could
    never place it, and the job would wait until its deadline."""
    from tuning.profile import parse_config, trial_bundles

    job = load("rayjob.yaml")["spec"]
    cfg, options = parse_config(shlex.split(job["entrypoint"])[2:])
    for group in job["rayClusterSpec"]["workerGroupSpecs"]:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        if limits.get("nvidia.com/gpu"):
            wanted = trial_bundles("GPU", cfg.tp_size, options.cpus)
            assert sum(b.get("GPU", 0) for b in wanted) <= int(limits["nvidia.com/gpu"]), group["groupName"]
            assert sum(b["CPU"] for b in wanted) <= float(limits["cpu"]), group["groupName"]


def test_gpu_groups_declare_their_accelerator_type():
    for name in MANIFESTS:
        spec = load(name)["spec"]
        cluster = spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or spec
        for group in cluster["workerGroupSpecs"]:
            gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
            if gpus:
                resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
                assert any(k.startswith("accelerator_type:") for k in resources), (name, group["groupName"])
                assert group["template"]["spec"]["nodeSelector"], (name, group["groupName"])


def test_images_and_ray_versions_are_consistent():
    versions, imgs = set(), set()
    for name in MANIFESTS:
        spec = load(name)["spec"]
        cluster = spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or spec
        versions.add(cluster["rayVersion"])
        imgs.update(images(cluster))
    assert versions == {version("ray")}, versions
    assert len(imgs) == 1, imgs


def test_every_pod_that_may_run_a_replica_mounts_the_models_the_app_loads():
    """The ingress asks for no CPU, so Serve may place it on any pod, the head included; it loads the target's
    tokenizer from the app's model path at start, which failed on a pod without the volume."""
    spec = load("rayservice.yaml")["spec"]
    args = yaml.safe_load(spec["serveConfigV2"])["applications"][0]["args"]
    cluster = spec["rayClusterConfig"]
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for pod in pods:
        mounts = [m["mountPath"] for c in pod["template"]["spec"]["containers"] for m in c.get("volumeMounts", [])]
        for path in (args["target"], args["draft"]):
            assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), (pod.get("groupName", "head"), path)
