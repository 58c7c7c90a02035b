"""Where model actors run: the resources of one actor, the bundles a Serve replica reserves for the actors
it owns, and the options that start an actor in one of those bundles (the one copy of this code)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    accelerator_type: str | None = None  # pin to this GPU type (e.g. A100, L4)

    def options(self) -> dict:
        """``actor.options(**...)`` for one model actor (outside any placement group)."""
        opts: dict = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts

    def bundle(self) -> dict[str, float]:
        rank = {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}
        if self.accelerator_type:
            rank[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return rank


def bundles(resources: ActorResources, actors: int) -> list[dict]:
    """One bundle per model actor a replica owns; the (resource-free) replica shares bundle 0 with the first
    actor. (Ray refuses an all-zero bundle, and a separate token bundle for the replica would make a config
    that fills the machine exactly — one CPU per model actor on two cores — unplaceable.)"""
    return [resources.bundle() for _ in range(actors)]


def in_bundle(resources: ActorResources, index: int) -> dict:
    """Options that start an actor in bundle ``index`` of the caller's placement group, or anywhere when
    the caller has none (in-process tests, a Tune trial without one). Inside the group the bundle already
    holds the accelerator type, so only the amounts are asked for."""
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_current_placement_group()
    if pg is None:
        return resources.options()
    return {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)}
