"""``build_app(args)``: the Serve application (ingress + draft + tensor-parallel target) from a config dict.

    serve run deployments/config.yaml            # or: serve run deployments.app:build_app target=... tp_size=2

Usable as an ``import_path`` in a Serve config / RayService ``serveConfigV2``.
"""

from __future__ import annotations

import ray
from ray.serve import Application

from deployments.autoscaling import autoscaling_config
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
    strategy = _strategy(cfg)
    # Serve queues a replica's requests beyond max_ongoing_requests (default 5) out of our sight: the ingress
    # takes every request so max_concurrent (-> 429) is the limit and /health never waits behind generation;
    # the model deployments only hand out actor handles (actors() returns at once).
    health = {"health_check_period_s": cfg.health_check_period_s,
              "health_check_timeout_s": cfg.health_check_timeout_s, "max_ongoing_requests": 256,
              "graceful_shutdown_timeout_s": cfg.drain_timeout_s}  # the time __del__ may drain held requests
    scaling = ({"autoscaling_config": autoscaling_config(cfg.autoscaling)} if cfg.autoscaling
               else {"num_replicas": cfg.num_replicas})
    draft = None
    if cfg.draft:
        draft = DraftDeployment.options(placement_group_bundles=replica_bundles(cfg, 1),
                                        placement_group_strategy=strategy, **scaling, **health).bind(config)
    target = TargetDeployment.options(placement_group_bundles=replica_bundles(cfg, cfg.tp_size),
                                      placement_group_strategy=strategy, **scaling, **health).bind(config)
    return OpenAIIngress.options(num_replicas=cfg.num_replicas, max_ongoing_requests=cfg.max_concurrent + 64
                                 ).bind(config, draft, target)


def _strategy(cfg: ServeConfig) -> str:
    return "STRICT_PACK" if cfg.num_gpus else "PACK"


def demands(cfg: ServeConfig) -> list[Demand]:
    """What the model deployments reserve at start (the ingress reserves nothing)."""
    replicas = max(1, int(cfg.autoscaling.get("min_replicas", 1))) if cfg.autoscaling else cfg.num_replicas
    out = [Demand("TargetDeployment", tuple(replica_bundles(cfg, cfg.tp_size)), _strategy(cfg), replicas)]
    if cfg.draft:
        out.insert(0, Demand("DraftDeployment", tuple(replica_bundles(cfg, 1)), _strategy(cfg), replicas))
    return out
