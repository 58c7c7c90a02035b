"""Autoscaling the model deployments on the requests their actors hold.

Serve's default policy counts a replica's ongoing Serve calls, but the ingress asks a TargetDeployment or
DraftDeployment replica only for its actors' handles (``actors()`` returns at once) and then calls the actors
directly every step, so that count stays near zero however busy the models are. Each replica reports
instead how many requests its actors hold (``record_autoscaling_stats``), and ``held_requests_policy``
sizes the deployment to ceil(held requests / ``target_ongoing_requests``) replicas, within the bounds;
Serve still applies the up/down-scaling delays and factors around it.
"""

from __future__ import annotations

import math

HELD = "held_requests"
POLICY = "deployments.autoscaling:held_requests_policy"


def held_requests_policy(ctx) -> tuple[int, dict]:
    """``ctx``: Serve's AutoscalingContext (``aggregated_metrics`` = {metric: {replica: mean over the
    look-back window}}; replicas without a report yet are absent)."""
    held = sum((ctx.aggregated_metrics or {}).get(HELD, {}).values())
    low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    wanted = math.ceil(held / ctx.config.target_ongoing_requests) if held > 0 else low
    return max(low, min(high, wanted)), {"held_requests": held}


def autoscaling_config(user: dict) -> dict:
    """The user's autoscaling_config with this policy unless they named one."""
    return {"policy": {"policy_function": POLICY}, **user}
