"""Fail fast when the cluster can never place the application, instead of replicas waiting for ever.

Serve keeps a replica whose resources no node has "waiting to be scheduled" without an error, so a config
asking for more CPUs than the machine has (or a GPU type the cluster lacks) looks like a service that never
answers. ``check_placeable`` compares what the app's replicas reserve (their placement-group bundles)
with the nodes the cluster has *now*: every bundle must fit some node, a ``STRICT_PACK`` replica's bundles
must fit one node together, every replica's bundles must fit the cluster's total, and all the replicas'
placement groups must pack onto the nodes together (a node's room taken by one replica is not another's:
three 2-GPU ``STRICT_PACK`` groups do not fit two 3-GPU nodes, though 6 GPUs do). On an autoscaling
cluster whose nodes come later (KubeRay worker groups scaling from zero) the check is turned off in the
config (``check_placement: false``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

PACK_STEPS = 100_000  # placements the packing search may try; beyond, the application is taken as placeable


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
    _packs(demands, nodes)


def _fits_a_node(demand: Demand, need: dict[str, float], nodes: list[dict[str, float]], what: str) -> None:
    if any(_covers(node, need) for node in nodes):
        return
    resource = next((r for r in need if not any(node.get(r, 0.0) >= need[r] for node in nodes)), None)
    if resource is None:  # each resource on some node, never all of them on one
        raise Unplaceable(f"deployment {demand.deployment} needs {_fmt_need(need)} on one node for {what}: some node "
                          f"has each of them, none has them all; lower the request (num_cpus, num_gpus) to fit one "
                          f"node, or add nodes that offer them together")
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


def _packs(demands: list[Demand], nodes: list[dict[str, float]]) -> None:
    """Raise when the replicas' placement groups cannot all be placed on ``nodes`` at once. Each unit — a
    ``STRICT_PACK`` group as one, a ``PACK`` group's bundles one by one (Ray may spread them) — takes its room on
    one node, largest first (first-fit decreasing), backtracking when a unit finds no room: Ray places the groups
    one by one, but a deploy is refused only when no placement exists at all."""
    units = sorted(_units(demands), key=lambda unit: _share(unit[1], nodes), reverse=True)
    free, budget = [dict(node) for node in nodes], [PACK_STEPS]
    stuck = _place(units, 0, free, budget)
    if stuck is not None:
        name, need = stuck
        raise Unplaceable(f"deployment {name} cannot place all its replicas: the cluster's nodes fit every replica "
                          f"alone, but not all of the application's placement groups together (its {_fmt_need(need)} "
                          f"find no node with room left once the others are placed); lower num_replicas (or "
                          f"min_replicas), or add nodes")


def _units(demands: list[Demand]) -> list[tuple[str, dict[str, float]]]:
    """What must land on one node each: (deployment, resources) per STRICT_PACK group or per PACK bundle."""
    out = []
    for demand in demands:
        for _ in range(demand.replicas):
            if demand.strategy == "STRICT_PACK":
                out.append((demand.deployment, _total([demand.bundles])))
            else:
                out.extend((demand.deployment, dict(bundle)) for bundle in demand.bundles)
    return out


def _share(need: dict[str, float], nodes: list[dict[str, float]]) -> float:
    """A unit's size for the decreasing order: its largest share of the cluster's total of any resource."""
    cluster = _total([tuple(nodes)])
    return max((amount / cluster[r] for r, amount in need.items() if cluster.get(r)), default=0.0)


def _place(units: list, i: int, free: list[dict[str, float]], budget: list[int]) -> tuple | None:
    """Place ``units[i:]`` on the ``free`` room left (first fit, backtracking): None when they all fit (or the
    search ran out of ``budget``), else a unit that found no room (the first fit's, for the message)."""
    if i == len(units):
        return None
    stuck, tried = None, []  # a node with the same room left as one tried already would fail the same way
    for node in free:
        if not _covers(node, units[i][1]) or node in tried:
            continue
        tried.append(dict(node))
        budget[0] -= 1
        _take(node, units[i][1], -1.0)
        deeper = _place(units, i + 1, free, budget) if budget[0] > 0 else None
        _take(node, units[i][1], 1.0)
        if deeper is None:
            return None
        stuck = stuck or deeper
    return stuck or units[i]


def _take(node: dict[str, float], need: dict[str, float], sign: float) -> None:
    for resource, amount in need.items():
        node[resource] = node.get(resource, 0.0) + sign * amount


def _fmt_need(need: dict[str, float]) -> str:
    return ", ".join(f"{_fmt(amount)} {resource}" for resource, amount in sorted(need.items()))


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
