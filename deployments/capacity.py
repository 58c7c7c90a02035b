"""Fail fast when the cluster can never place the application, instead of replicas waiting for ever.

Serve keeps a replica whose resources no node has "waiting to be scheduled" without an error, so a config
asking for more CPUs than the machine has (or a GPU type the cluster lacks) looks like a service that never
answers. ``check_placeable`` compares what the app's replicas reserve (their placement-group bundles)
with the nodes the cluster has *now*: every bundle must fit some node, a ``STRICT_PACK`` replica's bundles
must fit one node together, and every replica's bundles must fit the cluster's total. On an autoscaling
cluster whose nodes come later (KubeRay worker groups scaling from zero) the check is turned off in the
config (``check_placement: false``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Demand:
    """What one deployment reserves: ``replicas`` placement groups of ``bundles``."""

    deployment: str
    bundles: tuple[dict[str, float], ...]
    strategy: str = "PACK"  # PACK | STRICT_PACK
    replicas: int = 1


class Unplaceable(ValueError):
    """The application asks for resources the cluster does not have; names the resource and the fix."""


FIXES = {
    "CPU": "lower num_cpus (the logical CPUs each model actor reserves; `threads` sets the cores torch uses) "
           "or add CPU nodes",
    "GPU": "lower num_gpus, set num_gpus: 0 and device: cpu to serve on CPUs, or add GPU nodes",
    "memory": "lower the memory asked for or add nodes",
}


def check_placeable(demands: list[Demand], nodes: list[dict[str, float]]) -> None:
    """Raise ``Unplaceable`` when no placement of ``demands`` on ``nodes`` (their total resources) exists."""
    for demand in demands:
        for bundle in demand.bundles:
            _fits_a_node(demand, bundle, nodes, "one of its bundles")
        if demand.strategy == "STRICT_PACK":
            _fits_a_node(demand, _total([demand.bundles]), nodes, f"its {len(demand.bundles)} bundles together")
    _fits_the_cluster(demands, _total([tuple(nodes)]))


def _fits_a_node(demand: Demand, need: dict[str, float], nodes: list[dict[str, float]], what: str) -> None:
    if any(_covers(node, need) for node in nodes):
        return
    resource = next(r for r in need if not any(node.get(r, 0.0) >= need[r] for node in nodes))
    largest = max((node.get(resource, 0.0) for node in nodes), default=0.0)
    raise Unplaceable(f"deployment {demand.deployment} needs {_fmt(need[resource])} {resource} on one node for "
                      f"{what}, but the largest node has {_fmt(largest)}; {_fix(resource)}")


def _fits_the_cluster(demands: list[Demand], cluster: dict[str, float]) -> None:
    parts = {d.deployment: _total([d.bundles] * d.replicas) for d in demands}
    need = _total([tuple(parts.values())])
    for resource, amount in need.items():
        if amount > cluster.get(resource, 0.0) + 1e-9:
            split = " + ".join(f"{name} {_fmt(p[resource])}" for name, p in parts.items() if p.get(resource))
            raise Unplaceable(f"the application needs {_fmt(amount)} {resource} in all ({split}) but the cluster has "
                              f"{_fmt(cluster.get(resource, 0.0))}; {_fix(resource)}")


def _covers(node: dict[str, float], need: dict[str, float]) -> bool:
    return all(node.get(r, 0.0) + 1e-9 >= amount for r, amount in need.items())


def _total(groups: list[tuple[dict[str, float], ...]]) -> dict[str, float]:
    out: Counter = Counter()
    for group in groups:
        for bundle in group:
            for resource, amount in bundle.items():
                out[resource] += amount
    return {r: a for r, a in out.items() if a > 0}


def _fix(resource: str) -> str:
    if resource.startswith("accelerator_type:"):
        return (f"no node offers {resource}: set accelerator_type to a type the cluster has, or add a worker "
                "group of that type")
    return FIXES.get(resource, f"add nodes that offer {resource}")


def _fmt(value: float) -> str:
    return f"{value:g}"


def cluster_nodes() -> list[dict[str, float]]:
    """Total resources of every live node of the connected Ray cluster."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
