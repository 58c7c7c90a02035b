"""KubeRay manifests: valid against the CRD schemas (made strict), app args valid, job args parse, versions
consistent, the README's Kubernetes steps in step with them."""

from __future__ import annotations

import copy
import functools
import importlib.util
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
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
DRAIN_MARGIN_S = 30  # beyond the app's drain_timeout_s: Serve's own stop, a replacement replica's start


def load(name: str) -> dict:
    return yaml.safe_load((REPO / "k8s" / name).read_text())


def strict(schema: dict) -> dict:
    """A copy of a CRD schema that refuses unknown fields: ``additionalProperties: false`` on every object with
    ``properties`` (and no ``x-kubernetes-preserve-unknown-fields``), as the API server prunes or, with
    kubectl's strict field validation, refuses them. The vendored schemas have none, so a misspelt field
    (``tolerationz``) validated."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if not isinstance(node, dict):
            return
        if ("properties" in node and not node.get("x-kubernetes-preserve-unknown-fields")
                and "additionalProperties" not in node):
            node["additionalProperties"] = False
        for sub in node.get("properties", {}).values():
            visit(sub)
        for key in ("items", "additionalProperties", "not"):
            visit(node.get(key))
        for key in ("allOf", "anyOf", "oneOf"):
            for sub in node.get(key, []):
                visit(sub)

    visit(schema)
    return schema


@functools.cache
def schema_of(manifest: str, strict_copy: bool = True):
    """A validator of ``manifest``'s kind: the strict copy of its CRD schema, or the vendored one as it is."""
    schema = json.loads((SCHEMAS / MANIFESTS[manifest]).read_text())
    schema = strict(schema) if strict_copy else schema
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def cluster_of_manifest(manifest: dict) -> dict:
    spec = manifest["spec"]
    return spec.get("rayClusterConfig") or spec.get("rayClusterSpec") or spec


def cluster_of(name: str) -> dict:
    return cluster_of_manifest(load(name))


def pods(name: str) -> list[tuple[str, dict]]:
    """(group name, pod spec) of the head and every worker group of a manifest's cluster."""
    cluster = cluster_of(name)
    return [("head", cluster["headGroupSpec"]["template"]["spec"]),
            *((g["groupName"], g["template"]["spec"]) for g in cluster["workerGroupSpecs"])]


def gpu_groups(name: str) -> list[dict]:
    return [g for g in cluster_of(name)["workerGroupSpecs"]
            if g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")]


def node_resources(group: dict) -> dict[str, float]:
    """The Ray resources a worker group's node starts with: its container's CPU and GPU limits (KubeRay's
    num-cpus / num-gpus) and the custom resources of its rayStartParams."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    custom = group["rayStartParams"].get("resources")
    return {"CPU": float(limits["cpu"]), "GPU": float(limits.get("nvidia.com/gpu", 0)),
            **(json.loads(json.loads(custom)) if custom else {})}


def app_args() -> dict:
    return yaml.safe_load(load("rayservice.yaml")["spec"]["serveConfigV2"])["applications"][0]["args"]


def readme_commands() -> list[str]:
    """The shell commands of the README's Kubernetes section (its bash block), continuation lines joined,
    comment lines left out."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Kubernetes (KubeRay)", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def readme_profile_argv() -> list[str]:
    """The arguments of the README's ``ray job submit ... -- python tuning/profile.py ...``."""
    line = next(c for c in readme_commands() if "tuning/profile.py" in c)
    argv = shlex.split(line, comments=True)
    job = argv[argv.index("--") + 1:]
    assert job[:2] == ["python", "tuning/profile.py"], job
    return job[2:]


def rayjob_argv() -> list[str]:
    argv = shlex.split(load("rayjob.yaml")["spec"]["entrypoint"])
    assert argv[:2] == ["python", "tuning/profile.py"]
    return argv[2:]


def images(obj) -> list[str]:
    if isinstance(obj, dict):
        own = [obj["image"]] if isinstance(obj.get("image"), str) else []
        return own + [i for v in obj.values() for i in images(v)]
    if isinstance(obj, list):
        return [i for v in obj for i in images(v)]
    return []


@pytest.mark.parametrize("manifest", list(MANIFESTS))
def test_manifest_validates_against_crd_schema(manifest):
    schema_of(manifest).validate(load(manifest))


def test_schema_check_catches_a_bad_manifest():
    bad = load("raycluster.yaml")
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        schema_of("raycluster.yaml").validate(bad)


@pytest.mark.parametrize("manifest", list(MANIFESTS))
@pytest.mark.parametrize("where", ["spec", "pod", "container"])
def test_strict_schema_check_catches_a_misspelt_field(manifest, where):
    """The vendored schemas allow any field, so ``tolerationz`` (or a misspelt KubeRay field) passed: the
    strict copy refuses it wherever it is."""
    bad = load(manifest)
    group = cluster_of_manifest(bad)["workerGroupSpecs"][0]
    target = {"spec": bad["spec"], "pod": group["template"]["spec"],
              "container": group["template"]["spec"]["containers"][0]}[where]
    target["tolerationz"] = [GPU_TOLERATION]
    schema_of(manifest, strict_copy=False).validate(bad)  # the vendored schema lets it through
    with pytest.raises(jsonschema.ValidationError, match="tolerationz"):
        schema_of(manifest).validate(bad)


def test_strict_schema_keeps_open_maps_open():
    """Maps (resources, labels, rayStartParams) and preserve-unknown-fields objects stay open."""
    ok = load("raycluster.yaml")
    group = ok["spec"]["workerGroupSpecs"][0]
    group["rayStartParams"]["object-store-memory"] = "1000000000"
    group["template"]["spec"]["containers"][0]["resources"]["limits"]["example.com/fpga"] = "1"
    group["template"].setdefault("metadata", {}).setdefault("labels", {})["team"] = "ml"
    schema_of("raycluster.yaml").validate(ok)


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


PROFILE_CLUSTERS = {"rayjob": (rayjob_argv, "rayjob.yaml"),  # the RayJob's entrypoint on its own cluster
                    "readme": (readme_profile_argv, "raycluster.yaml")}  # the README's command on sequoia-dev


@pytest.mark.parametrize("how", list(PROFILE_CLUSTERS))
def test_a_profiling_trial_fits_one_node_of_every_gpu_group(how):
    """A trial with --tp-size N takes N + 1 GPUs and as many bundles of CPUs (the draft and each rank), all on
    one node (STRICT_PACK): a group whose node has less could never place it, and the job would wait until its
    deadline (raycluster.yaml's GPU pods had 2 GPUs for a 3-GPU trial)."""
    from tuning.profile import parse_config, trial_need

    argv, manifest = PROFILE_CLUSTERS[how]
    cfg, options = parse_config(argv())
    assert cfg.tp_size == 2
    groups = gpu_groups(manifest)
    assert groups, manifest
    for group in groups:
        node = node_resources(group)
        hw = next(k.split(":", 1)[1] for k in node if k.startswith("accelerator_type:"))
        need = trial_need(hw, cfg.tp_size, options.cpus)
        assert all(node.get(k, 0) >= v for k, v in need.items()), (manifest, group["groupName"], need, node)


@pytest.mark.parametrize("how", list(PROFILE_CLUSTERS))
def test_profiles_file_plans_under_the_pair_the_service_serves(how):
    """Plans are filed under pair_key(draft, target): a profile without --draft/--target measured the default
    pair and filed its plans where the RayService (/models/draft, /models/target) never looks."""
    from sequoia_ray.plan_store import pair_key
    from tuning.profile import parse_config

    cfg, _ = parse_config(PROFILE_CLUSTERS[how][0]())
    args = app_args()
    assert (cfg.draft, cfg.target) == (args["draft"], args["target"])
    assert pair_key(cfg.draft, cfg.target) == pair_key(args["draft"], args["target"])
    assert cfg.storage == args["plan_store"]


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


def test_every_pod_that_may_run_a_trial_or_replica_mounts_the_models():
    """Every pod of the standalone cluster (trials, replicas and a num_cpus-0 ingress may land anywhere) and
    every worker of the profiling job reads the checkpoints at /models from the shared claim; the standalone
    cluster mounted nothing."""
    args = app_args()
    wanted = [*pods("raycluster.yaml"), *pods("rayservice.yaml"), *pods("rayjob.yaml")[1:]]
    for group, pod in wanted:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
        mounts = {m["mountPath"].rstrip("/"): m for c in pod["containers"] for m in c.get("volumeMounts", [])}
        for path in (args["draft"], args["target"]):
            mount = next((m for p, m in mounts.items() if path.startswith(p + "/")), None)
            assert mount is not None, (group, path)
            assert claims.get(mount["name"]) == "sequoia-models" and mount.get("readOnly") is True, (group, mount)


def test_the_models_claim_is_shipped_and_mountable_on_many_nodes():
    """The claim the manifests mount exists in k8s/ and is ReadOnlyMany: pods of several nodes mount it at once
    (a ReadWriteOnce volume attaches to one node, the other pods stay Pending)."""
    pvc = load("pvc.yaml")
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    claims = {v["persistentVolumeClaim"]["claimName"] for name in MANIFESTS for _, pod in pods(name)
              for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    assert claims == {pvc["metadata"]["name"]}
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"]
    text = (REPO / "k8s" / "pvc.yaml").read_text()
    args = app_args()
    for path in (args["draft"], args["target"]):  # how to fill it: the paths the app loads
        assert path in text
    assert "config.json" in text


def test_readme_steps_build_the_image_and_create_what_the_manifests_use():
    """The image in the manifests is a placeholder: the steps build and push one from k8s/Dockerfile and set
    `image:`; they apply the claim before anything mounts it, and every manifest."""
    commands = readme_commands()
    text = "\n".join(commands)
    assert any(c.startswith("docker build") and "-f k8s/Dockerfile" in c for c in commands), text
    assert any("docker push" in c for c in commands), text
    section = (REPO / "README.md").read_text().split("## Kubernetes (KubeRay)", 1)[1].split("\n## ", 1)[0]
    assert "`image:`" in section
    applied = [shlex.split(c)[3] for c in commands if c.startswith("kubectl apply -f")]
    assert set(applied) >= {f"k8s/{m}" for m in [*MANIFESTS, "pvc.yaml"]}, applied
    assert applied.index("k8s/pvc.yaml") < min(applied.index(f"k8s/{m}") for m in MANIFESTS)


def head_service(manifest: dict) -> str:
    """The head service KubeRay creates (utils.GenerateHeadServiceName): <name>-head-svc, for a RayCluster unless
    its headGroupSpec.headService names another."""
    named = (manifest["spec"].get("headGroupSpec", {}).get("headService", {}).get("metadata", {}).get("name")
             if manifest["kind"] == "RayCluster" else None)
    return named or f"{manifest['metadata']['name']}-head-svc"


def test_head_services_do_not_clash_and_the_readme_forwards_the_dev_cluster():
    """The standalone RayCluster and the RayService were both `sequoia`, so both wanted sequoia-head-svc."""
    manifests = [load(name) for name in MANIFESTS]
    services = [head_service(m) for m in manifests]
    assert len(set(services)) == len(services), services
    assert len({m["metadata"]["name"] for m in manifests}) == len(manifests)
    forward = next(c for c in readme_commands() if c.startswith("kubectl port-forward"))
    assert f"svc/{head_service(load('raycluster.yaml'))}" in shlex.split(forward, comments=True), forward
    watch = [c for c in (REPO / "README.md").read_text().splitlines() if "kubectl get rayservice" in c]
    assert all(f"kubectl get rayservice {load('rayservice.yaml')['metadata']['name']} " in c for c in watch)


def test_an_upgrade_and_a_pod_deletion_outlast_the_drain():
    """A replica being removed waits drain_timeout_s for its requests; KubeRay deleted the old cluster 60 s after
    a switch and Kubernetes killed a pod 30 s after SIGTERM, cutting the streams still held."""
    from deployments.config import ServeConfig

    spec = load("rayservice.yaml")["spec"]
    drain = ServeConfig.model_validate(app_args()).drain_timeout_s
    assert spec.get("rayClusterDeletionDelaySeconds", 60) >= drain + DRAIN_MARGIN_S
    ray_dir = Path(importlib.util.find_spec("ray").origin).parent
    assert '"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"' in (ray_dir / "_private" / "ray_constants.py").read_text()
    for group, pod in pods("rayservice.yaml"):
        grace = pod.get("terminationGracePeriodSeconds", 30)
        assert grace >= drain + DRAIN_MARGIN_S, group
        for container in pod["containers"]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            node_drain = float(env.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", 30))  # Ray's SIGTERM drain
            assert drain <= node_drain < grace, (group, node_drain, grace)


@pytest.mark.parametrize("manifest", list(MANIFESTS))
def test_gpu_pods_tolerate_the_gpu_taint(manifest):
    """GPU nodes are usually tainted nvidia.com/gpu:NoSchedule (GPU Operator, GKE, AKS): without the toleration
    a GPU pod stays Pending."""
    groups = gpu_groups(manifest)
    assert groups
    for group in groups:
        assert GPU_TOLERATION in group["template"]["spec"].get("tolerations", []), group["groupName"]


def test_rayservice_sets_no_deprecated_fields():
    """KubeRay ignores these (kuberay#1685): they only suggested a restart policy that does not exist."""
    spec = load("rayservice.yaml")["spec"]
    assert "serviceUnhealthySecondThreshold" not in spec
    assert "deploymentUnhealthySecondThreshold" not in spec


@pytest.mark.parametrize("command", ["rayjob", "readme"])
def test_profile_commands_quote_glob_characters(command):
    """KubeRay's submitter runs the entrypoint through bash, where an unquoted `?` (the store's ?region=) is a
    glob."""
    line = (load("rayjob.yaml")["spec"]["entrypoint"] if command == "rayjob"
            else next(c for c in readme_commands() if "tuning/profile.py" in c))
    lexer = shlex.shlex(line, posix=False)
    lexer.whitespace_split = True
    for token in lexer:
        if any(ch in token for ch in "?*["):
            assert token[0] in "'\"" and token[-1] == token[0], token


def test_rayjob_does_not_retry():
    """A retry is a new cluster rerunning every trial; a failed trial fails the job after the others published
    (rerun that type alone)."""
    job = load("rayjob.yaml")["spec"]
    assert job["backoffLimit"] == 0
    lines = (REPO / "k8s" / "rayjob.yaml").read_text().splitlines()
    assert lines[lines.index("  backoffLimit: 0") - 1].lstrip().startswith("#"), "say why, in a comment"


def test_the_image_pins_the_torch_every_script_installs():
    """Ray's GPU images ship no torch: unpinned, the project's install took PyPI's newest (a CUDA build that may
    want a newer driver than the nodes have). The image pins the version scripts/setup.sh installs (its CUDA
    build), and its work folder is made by the image's user, where the editable install writes."""
    import re

    docker = (REPO / "k8s" / "Dockerfile").read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pinned = re.search(r"^ARG TORCH_SPEC=(torch==[\d.]+)$", docker, re.M)
    served = re.search(r"TORCH_SPEC=\$\{SEQUOIA_TORCH:-(torch==[\d.]+)\+cpu\}", setup)
    assert pinned and served and pinned.group(1) == served.group(1), (pinned, served)
    lines = [line for line in docker.splitlines() if line and not line.startswith("#")]
    install = next(i for i, line in enumerate(lines) if line.startswith("RUN pip install") and "-e ." in line)
    assert '"$TORCH_SPEC"' in lines[install]  # the project's install keeps that torch
    assert any(line.startswith("RUN pip install") and "$TORCH_SPEC" in line for line in lines[:install])
    workdir = next(i for i, line in enumerate(lines) if line.startswith("WORKDIR "))
    assert lines[workdir - 1] == f"RUN mkdir -p {lines[workdir].split()[1]}"
