"""``build_app(args)``: the Serve application (ingress + draft + tensor-parallel target) from a config dict.

    serve run deployments/config.yaml            # or: serve run deployments.app:build_app target=... tp_size=2

Usable as an ``import_path`` in a Serve config / RayService ``serveConfigV2``.
"""

from __future__ import annotations

import ray
from ray.serve import Application

from deployments.autoscaling import autoscaling_config, check_reachable, ingress_autoscaling_config, model_bounds
from deployments.capacity import Demand, check_placeable, cluster_nodes
from deployments.config import ServeConfig
from deployments.ingress import OpenAIIngress
from deployments.model_deployments import DraftDeployment, TargetDeployment, replica_bundles


def build_app(args: dict) -> Application:
    """Raises ``Unplaceable`` (naming the resource and the fix) when the connected cluster can never place the
    model actors — instead of replicas waiting for ever to be scheduled."""
    cfg = ServeConfig.model_validate(args)
    if cfg.check_placement and ray.is_initialized():
        check_placeable(demands(cfg), cluster_nodes())
    config = cfg.model_dump()
    draft = DraftDeployment.options(**model_options(cfg, 1)).bind(config) if cfg.draft else None
    target = TargetDeployment.options(**model_options(cfg, cfg.tp_size)).bind(config)
    return OpenAIIngress.options(**ingress_options(cfg)).bind(config, draft, target)


def model_options(cfg: ServeConfig, actors: int) -> dict:
    """A model deployment's options: its placement group of ``actors`` bundles, its scaling and health."""
    # Serve queues a replica's requests beyond max_ongoing_requests (default 5) out of our sight: the ingress
    # takes every request so max_concurrent (-> 429) is the limit and /health never waits behind generation;
    # the model deployments only hand out actor handles (actors() returns at once).
    return {"placement_group_bundles": replica_bundles(cfg, actors), "placement_group_strategy": _strategy(cfg),
            "health_check_period_s": cfg.health_check_period_s,
            "health_check_timeout_s": cfg.health_check_timeout_s, "max_ongoing_requests": 256,
            "graceful_shutdown_timeout_s": cfg.drain_timeout_s,  # the time __del__ may drain held requests
            **_scaling(cfg)}


def ingress_options(cfg: ServeConfig) -> dict:
    """The ingress's options. It runs every request's decoding loop, so a replica Serve stops (a redeploy, a
    scale-down) gets the models' drain_timeout_s to finish its streams, not Serve's default 20 s; and it scales
    with the model deployments, whose held requests it alone lets in (``ingress_autoscaling_config``)."""
    scaling: dict = {"num_replicas": cfg.num_replicas}
    if cfg.autoscaling:
        ingress = ingress_autoscaling_config(cfg.autoscaling, cfg.max_concurrent)
        check_reachable(cfg.autoscaling, ingress["max_replicas"], cfg.max_concurrent)  # a guard on the derivation
        scaling = {"autoscaling_config": ingress}
    return {"max_ongoing_requests": cfg.max_concurrent + 64, "graceful_shutdown_timeout_s": cfg.drain_timeout_s,
            **scaling}


def _scaling(cfg: ServeConfig) -> dict:
    if cfg.autoscaling:
        return {"autoscaling_config": autoscaling_config(cfg.autoscaling)}
    return {"num_replicas": cfg.num_replicas}


def _strategy(cfg: ServeConfig) -> str:
    return "STRICT_PACK" if cfg.num_gpus else "PACK"


def _starting_replicas(autoscaling: dict) -> int:
    """The replicas Serve starts: ``initial_replicas`` when given (min_replicas alone passed a config starting more
    than the cluster holds; the extra ones waited unscheduled), else ``min_replicas`` (at least 1)."""
    bounds = model_bounds(autoscaling)
    return max(1, bounds.initial_replicas if bounds.initial_replicas is not None else bounds.min_replicas)


def demands(cfg: ServeConfig) -> list[Demand]:
    """What the model deployments reserve at start (the ingress reserves nothing)."""
    replicas = _starting_replicas(cfg.autoscaling) if cfg.autoscaling else cfg.num_replicas
    out = [Demand("TargetDeployment", tuple(replica_bundles(cfg, cfg.tp_size)), _strategy(cfg), replicas)]
    if cfg.draft:
        out.insert(0, Demand("DraftDeployment", tuple(replica_bundles(cfg, 1)), _strategy(cfg), replicas))
    return out
