"""``build_app(args)``: the Serve application (ingress + draft + tensor-parallel target) from a config dict.

    serve run deployments/config.yaml            # or: serve run deployments.app:build_app target=... tp_size=2

Usable as an ``import_path`` in a Serve config / RayService ``serveConfigV2``.
"""

from __future__ import annotations

from ray.serve import Application

from deployments.autoscaling import autoscaling_config
from deployments.ingress import OpenAIIngress
from deployments.config import ServeConfig
from deployments.model_deployments import DraftDeployment, TargetDeployment, replica_bundles


def build_app(args: dict) -> Application:
    cfg = ServeConfig.model_validate(args)
    config = cfg.model_dump()
    strategy = "STRICT_PACK" if cfg.num_gpus else "PACK"
    # Serve queues a replica's requests beyond max_ongoing_requests (default 5) out of our sight: the ingress
    # takes every request so max_concurrent (-> 429) is the limit and /health never waits behind generation;
    # the model deployments only hand out actor handles (actors() returns at once).
    health = {"health_check_period_s": cfg.health_check_period_s,
              "health_check_timeout_s": cfg.health_check_timeout_s, "max_ongoing_requests": 256}
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
