"""Ray Tune job: profile every hardware type of the fleet and publish per-hardware tree plans.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python tuning/profile.py --smoke-test --storage /tmp/sequoia-plans

One Tune trial per hardware type present in the cluster (its ``accelerator_type:<X>`` resources) or given
with ``--hardware``; a CPU-only cluster gets one CPU trial. Each trial is pinned to its type by a tiny
``accelerator_type`` demand and reserves one bundle per tensor-parallel rank. A trial loads the pair,
measures the acceptance vector per temperature, profiles t(n) and c (and, with the target in process, the
batched T_B and C_B of every batch bucket), runs the DP, chooses (n, d) per batch bucket (1, 2, 4, 8, 16),
runs the batch-1 plan for real, and publishes one plan per bucket, the profile and a heatmap to the plan
store; the printed table has a row per temperature and bucket. A tensor-parallel trial's target is a group
of rank actors: its profile has no batch tables and the buckets are extrapolated (``sequoia_ray.hardware``). Tune's own
results go under <storage>/tune. ``sequoia-ray profile`` runs the same trial in-process without Ray.

Plans are filed under the hardware id of what was measured, the id serving looks them up by: the GPU type when
the models ran on it, else the CPU's, which counts the torch threads (``--threads``, by default the target's in
deployments/config.yaml; each bundle reserves as many CPUs unless ``--cpus-per-trial``). A ``--device cpu`` trial
on a GPU node files the node's CPU, not its GPU. Relative local paths (store, prompts, acceptance files, model
checkpoints) are made absolute first: each trial runs in a directory of its own.

A ``--hardware`` type no node of the cluster has is refused before any trial starts (exit code 2: its trial
would wait for ever), unless ``--no-check-placement`` (worker groups that scale from zero: the autoscaler
starts the node). A trial that fails does not stop the others: each publishes its own plans, the table shows
those that succeeded, a line ``failed: <hardware>: <error>`` each that did not, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Run as a script, this folder is sys.path[0] and this file would shadow the standard library's `profile`
# module (cProfile imports it, and torch imports cProfile): put the repo root there instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from sequoia_ray.arguments import (EXIT_BAD_INPUT, Parser, add_job_args, is_uri, job_config,  # noqa: E402
                                   model_source, one_line, positive_int, shown_uri)
from sequoia_ray.config import ProfileJobConfig  # noqa: E402
from sequoia_ray.hardware import SERVED_THREADS  # noqa: E402,F401 (tests import it from here too)
from sequoia_ray.paths import user_path

ACCEL_PREFIX = "accelerator_type:"
CPU = "cpu"
EXIT_TRIAL_FAILED = 1  # some trial failed (the others' plans are published)
# SERVED_THREADS (sequoia_ray.hardware): the trial's 1 CPU, hence 1 thread, filed plans under ``...-1c`` where the
# shipped config serves ``...-2c``.


@dataclass(frozen=True)
class TrialOptions:
    """The driver's own options, beside the job config every trial gets."""

    cpus: float  # logical CPUs of each of a trial's bundles
    check_placement: bool = True  # refuse a hardware type no node has now (off: the autoscaler may start one)
    threads: int | None = None  # torch threads of a trial's forwards (a CPU hardware id counts them); None: torch's


class MissingHardware(ValueError):
    """A hardware type to profile that no node of the cluster has: its trial would wait for ever."""


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="tuning/profile.py", description=__doc__.splitlines()[0])
    add_job_args(p)
    p.add_argument("--hardware", default="", help="comma-separated accelerator types (default: all in cluster)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads of each trial's forwards, and of a CPU trial's hardware id (cpu-<model>-<isa>-"
                        "<threads>c): the target's threads in the Serve config that will serve the plans (default: "
                        "deployments/config.yaml's, so that its service finds them)")
    p.add_argument("--cpus-per-trial", type=float, default=None,
                   help="logical CPUs each trial bundle reserves (default: --threads)")
    p.add_argument("--no-check-placement", dest="check_placement", action="store_false",
                   help="start trials for --hardware types no node has yet (worker groups that scale from zero: the "
                        "autoscaler starts them), as the Serve config's check_placement: false; by default such a "
                        "type is refused, since its trial would wait for ever")
    return p


def parse_config(argv: list[str] | None) -> tuple[ProfileJobConfig, TrialOptions]:
    """The job config from the command line; bad input raises ValueError (or SystemExit(2) from argparse)."""
    args = build_parser().parse_args(argv)
    if args.cpus_per_trial is not None and not args.cpus_per_trial > 0:
        raise ValueError(f"--cpus-per-trial {args.cpus_per_trial} must be > 0")
    kinds = (h.strip() for h in args.hardware.split(","))
    cfg = job_config(args, hardware=tuple(dict.fromkeys(h for h in kinds if h)))  # each once: one trial a type
    threads = args.threads or SERVED_THREADS
    cpus = args.cpus_per_trial or float(threads)
    return absolute_paths(cfg), TrialOptions(cpus, args.check_placement, threads)


def absolute_paths(cfg: ProfileJobConfig) -> ProfileJobConfig:
    """``cfg`` with its local paths (store, prompts, acceptance files, draft and target checkpoints) absolute: Tune
    runs each trial in a directory of its own, where a relative path would name another file (or publish plans
    into the trial's directory while the driver reports them under the path given)."""
    return cfg.model_copy(update={
        "storage": join_uri(cfg.storage), "prompts": cfg.prompts and _local(cfg.prompts),
        "acceptance": {t: acceptance_value(v) for t, v in cfg.acceptance.items()},
        "draft": model_source(cfg.draft), "target": model_source(cfg.target)})


def acceptance_value(text: str) -> str:
    """An ``--acceptance`` value as the trials read it (``AcceptanceVector.parse``): a list of numbers as given
    (made a path, ``0.8,0.1`` became ``/cwd/0.8,0.1``, which no trial could read), a file's path absolute. The
    value was read once already, by ``job_config``: a bad one fails the command, not every trial after loading
    its models."""
    from sequoia_ray.tree.acceptance_vector import is_number_list

    return text if is_number_list(text) else _local(text)


def _local(path: str) -> str:
    return path if is_uri(path) else str(user_path(path).resolve())


def discover_hardware(resources: dict[str, float]) -> list[str]:
    """Accelerator types present in the cluster (``accelerator_type:A100`` -> ``A100``), else ``[cpu]``."""
    types = sorted(k[len(ACCEL_PREFIX):] for k in resources if k.startswith(ACCEL_PREFIX))
    return types or [CPU]


def hardware_resource(hw: str) -> str:
    """The cluster resource a trial of hardware type ``hw`` needs a node with (``trial_bundles`` pins it there)."""
    return "CPU" if hw == CPU else ACCEL_PREFIX + hw


def check_hardware(types: list[str], resources: dict[str, float], nodes: list[dict[str, float]] | None = None,
                   need=None) -> None:
    """MissingHardware naming the ``types`` whose resource (``hardware_resource``) the cluster's ``resources`` lack,
    the types it has and the fix: Tune would keep such a trial pending for ever, without an error. Given the alive
    ``nodes``' resources and ``need(hw)`` (what a trial takes on one node: ``trial_need``), also a type none of
    whose nodes can hold a trial (a 2-CPU trial on 1-CPU nodes waited for ever as well)."""
    missing = [hw for hw in types if not resources.get(hardware_resource(hw), 0) > 0]
    if missing:
        present = ", ".join(discover_hardware(resources))
        raise MissingHardware(
            f"--hardware {','.join(missing)}: no node of the cluster has the resource "
            f"{', '.join(map(hardware_resource, missing))} (its hardware types: {present}), so a trial would wait "
            f"for ever; name types the cluster has, or leave --hardware out to profile them all; if worker groups of "
            "that type scale from zero, pass --no-check-placement to let the autoscaler start their nodes")
    for hw in types if nodes is not None and need is not None else ():
        wanted = need(hw)
        if not any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in nodes):
            most = max((node.get("CPU", 0) for node in nodes if node.get(hardware_resource(hw), 0) > 0), default=0)
            raise MissingHardware(
                f"--hardware {hw}: a trial takes {', '.join(f'{k} {v:g}' for k, v in sorted(wanted.items()))} on one "
                f"node, more than any node of that type has (the most CPUs of one: {most:g}), so it would wait for "
                "ever; lower --threads or --cpus-per-trial (each bundle's CPUs), or pass --no-check-placement if the "
                "autoscaler adds larger nodes")


def trial_need(hw: str, tp_size: int, cpus: float) -> dict[str, float]:
    """What a trial of ``hw`` takes on one node: its bundles summed (a TP group's are packed on the trial's node,
    ``trial_resources``; a lone bundle is one)."""
    total: dict[str, float] = {}
    for bundle in trial_bundles(hw, tp_size, cpus):
        for key, value in bundle.items():
            total[key] = total.get(key, 0) + value
    return total


def root_cause(error: BaseException | str) -> str:
    """A failed trial's own error in one line (``ProfileError: timing noise ...``) from what Tune kept of it: a
    ``RayTaskError`` wrapping it (its ``cause``, unwrapped through nested actor errors), else the text of its
    trace (an error that could not be pickled), whose last line names it."""
    from ray.exceptions import RayError
    from ray.tune.error import TuneError

    while isinstance(getattr(error, "cause", None), BaseException):
        error = error.cause
    if isinstance(error, BaseException) and not isinstance(error, (RayError, TuneError)):
        return f"{type(error).__name__}: {one_line(error)}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def trial_bundles(hw: str, tp_size: int, cpus: float) -> list[dict[str, float]]:
    """The trial's own bundle (it runs the draft), then one bundle per tensor-parallel rank when tp > 1,
    every bundle pinned to the hardware type; CPU trials take CPUs only."""
    from actors.placement import ActorResources

    bundle = (ActorResources(cpus) if hw == CPU else ActorResources(cpus, 1, accelerator_type=hw)).bundle()
    return [dict(bundle) for _ in range(1 if tp_size == 1 else tp_size + 1)]


def trial_resources(hw: str, tp_size: int, cpus: float):
    """A trial's placement group: ``trial_bundles``, a TP group's all on the trial's node (``TargetGroup`` gives the
    ranks the trial node's address as the group's master, which rank 0 must listen on; Tune's default PACK may
    spread them, and a GPU trial whose tp equals a node's GPUs always spilled over), as Serve places a replica's."""
    from ray import tune

    return tune.PlacementGroupFactory(trial_bundles(hw, tp_size, cpus),
                                      strategy="STRICT_PACK" if tp_size > 1 else "PACK")


def join_uri(uri: str, *parts: str) -> str:
    """``parts`` under a store location: a URI keeps its query last; a local path is resolved (a ``?`` in it is part
    of a folder's name: ``plans?v2`` put Tune's results under ``plans/tune``)."""
    if not is_uri(uri):
        return str(user_path("/".join([uri.rstrip("/"), *parts])).resolve())
    base, _, query = uri.partition("?")
    path = "/".join([base.rstrip("/"), *parts])
    return f"{path}?{query}" if query else path


def trial_hardware_id(hw: str, device_type: str, tp_size: int, threads: int | None) -> str:
    """The hardware id a trial of type ``hw`` publishes under: that of what it measured. Its GPU type (Ray's name,
    as serving's) when the models ran on the GPU; else the CPU's id with the ``threads`` it ran
    (``sequoia_ray.hardware.hardware_id``), as serving names CPU actors on a GPU node
    (``ServeConfig.plan_hardware_id``): a ``--device cpu`` trial on an A100 node filed CPU timings under ``A100``,
    where a GPU server would serve them."""
    from sequoia_ray.hardware import hardware_id

    return hardware_id(hw if device_type == "cuda" else None, tp_size, threads)


def trainable(config: dict) -> None:
    """One Tune trial: everything for one hardware type (runs on a node of that type), at the job's torch
    threads (``TrialOptions.threads``)."""
    from ray import tune

    from actors.base import assigned_device
    from sequoia_ray.hardware import torch_threads
    from sequoia_ray.profiling import publish_heatmaps, run_trial

    cfg = ProfileJobConfig(**config["job"])
    threads = config.get("threads")
    device = assigned_device(cfg.device)  # the GPU Ray gave this trial, else the CPU (never an unassigned GPU)
    hw_id = trial_hardware_id(config["hw"], device.type, cfg.tp_size, threads)
    cfg = cfg.model_copy(update={"device": device.type})
    with torch_threads(threads):
        pair = None
        if cfg.tp_size > 1:  # the target as rank actors in this trial's bundles 1..tp
            from tuning.tp_pair import GroupPair

            on_gpu = device.type == "cuda"
            pair = GroupPair(cfg, backend="nccl" if on_gpu else "gloo", num_cpus=config.get("cpus", 1.0),
                             num_gpus=1 if on_gpu else 0, threads=threads)
        from actors.call_probe import measure_calls

        results, grids = run_trial(cfg, hw_id, progress=False, pair=pair, calls=measure_calls)
    publish_heatmaps(cfg, hw_id, grids)
    tune.report({"results": json.dumps([asdict(r) for r in results]),
                 "best_predicted_speedup": max(r.predicted_speedup for r in results)})


def run(cfg: ProfileJobConfig, options: TrialOptions) -> tuple[list[dict], list[str]]:
    """The result rows of the trials that succeeded (each published its own plans) and a line
    ``<hardware>: <error>`` per trial that failed; MissingHardware before any trial starts (``check_hardware``)."""
    import ray
    from ray import tune
    from ray.tune import RunConfig

    ray.init(ignore_reinit_error=True, log_to_driver=True)
    resources = ray.cluster_resources()
    types = list(cfg.hardware) or discover_hardware(resources)
    if options.check_placement:
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        check_hardware(types, resources, nodes, lambda hw: trial_need(hw, cfg.tp_size, options.cpus))
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    if alive > 1 and (not is_uri(cfg.storage) or cfg.storage.startswith("file:")):  # file:// is node-local too
        print(f"warning: --storage {shown_uri(cfg.storage)} is a local path on a cluster of {alive} nodes: each trial "
              "publishes on its own node's disk unless that path is one shared mount everywhere; give an s3://... URI "
              "otherwise", flush=True)
    print(f"profiling hardware types: {types}", flush=True)
    placed = tune.with_resources(
        trainable, lambda spec: trial_resources(spec["hw"], cfg.tp_size, options.cpus))
    tuner = tune.Tuner(
        placed, param_space={"hw": tune.grid_search(types), "job": cfg.model_dump(), "cpus": options.cpus,
                             "threads": options.threads},
        run_config=RunConfig(name="sequoia-profile", storage_path=join_uri(cfg.storage, "tune"), verbose=1))
    rows, failed = [], []
    for result in tuner.fit():
        if result.error:
            failed.append(f"{result.config.get('hw')}: {root_cause(result.error)}")
        else:
            rows += json.loads(result.metrics["results"])
    return rows, failed


def main(argv: list[str] | None = None) -> int:
    from sequoia_ray.plan_store import PlanStore, StoreError
    from sequoia_ray.profiling import TrialResult, format_results

    try:
        cfg, options = parse_config(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"tuning/profile.py: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:  # before Ray starts: Tune keeps its results under the store too, and failed there with a traceback
        PlanStore(cfg.storage).check_writable()
    except StoreError as exc:
        print(f"tuning/profile.py: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        rows, failed = run(cfg, options)
    except MissingHardware as exc:
        print(f"tuning/profile.py: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if rows:
        print(format_results([TrialResult(**r) for r in rows]))
        print(f"plans published under {shown_uri(cfg.storage)}")
    for line in failed:
        print(f"failed: {line}")
    return EXIT_TRIAL_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
