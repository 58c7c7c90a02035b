"""Autoscaling the model deployments on the requests their actors hold, and the ingress along with them.

Serve's default policy counts a replica's ongoing Serve calls, but the ingress asks a TargetDeployment or
DraftDeployment replica only for its actors' handles (``actors()`` returns at once) and then calls the actors
directly every step, so that count stays near zero however busy the models are. Each replica reports
instead how many requests its actors hold (``record_autoscaling_stats``), and ``held_requests_policy``
sizes the deployment to ceil(held requests / ``target_ongoing_requests``) replicas, within the bounds;
Serve still applies the up/down-scaling delays and factors around it.

Every held request is one an ingress replica runs (its decoding loop), and an ingress replica refuses beyond
``max_concurrent`` (429): the ingress scales too (``ingress_autoscaling_config``), or the held requests — and
with them the model replicas — could never grow past what a fixed ingress lets in. It scales on the same policy,
its replicas reporting the generations they run: one Serve call may run many (a batch of prompts, ``n``
choices), so Serve's count of its calls saw a replica full of batches as barely busy.
"""

from __future__ import annotations

import math

from ray.serve.config import AutoscalingConfig

HELD = "held_requests"
POLICY = "deployments.autoscaling:held_requests_policy"
# An ingress replica is added once the ingress averages this share of max_concurrent: before one has to refuse
# (Serve's count of a full replica never exceeds max_concurrent, so a target of max_concurrent never scales up).
INGRESS_HEADROOM = 0.75
_BOUNDS = ("policy", "min_replicas", "initial_replicas", "max_replicas", "target_ongoing_requests",
           "downscale_to_zero_delay_s")  # what the ingress derives or never needs (it keeps >= 1 replica)


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


def ingress_autoscaling_config(user: dict, max_concurrent: int) -> dict:
    """The ingress's autoscaling_config, derived from the model deployments' (``user``): bounds that carry the
    requests the models' min, initial and max replicas are sized for (``target_ongoing_requests`` held each),
    at ``INGRESS_HEADROOM * max_concurrent`` per ingress replica, on the generations its replicas run
    (``held_requests_policy``; a Serve call of several prompts or choices runs several). The user's delays and
    smoothing apply to it too."""
    model = model_bounds(user)
    per_replica = INGRESS_HEADROOM * max_concurrent

    def replicas(models: int) -> int:
        return max(1, math.ceil(models * model.target_ongoing_requests / per_replica - 1e-9))

    out = {key: value for key, value in user.items() if key not in _BOUNDS}
    out.update(min_replicas=replicas(model.min_replicas), max_replicas=replicas(model.max_replicas),
               target_ongoing_requests=per_replica, policy={"policy_function": POLICY})
    if model.initial_replicas is not None:
        out["initial_replicas"] = replicas(model.initial_replicas)
    return out


def model_bounds(user: dict) -> AutoscalingConfig:
    """The models' replica bounds and target with Serve's defaults and checks (their policy is Serve's to load)."""
    return AutoscalingConfig(**{key: value for key, value in user.items() if key != "policy"})


def check_reachable(user: dict, ingress_max_replicas: int, max_concurrent: int) -> None:
    """Raise ``ValueError`` when the ingress can never let in the requests the models' max_replicas need
    (more than (max_replicas - 1) * target_ongoing_requests held): those replicas would never start."""
    model = model_bounds(user)
    capacity = ingress_max_replicas * max_concurrent
    needed = (model.max_replicas - 1) * model.target_ongoing_requests
    if capacity <= needed:
        reachable = max(1, math.ceil(capacity / model.target_ongoing_requests))
        raise ValueError(
            f"autoscaling max_replicas {model.max_replicas} is unreachable: it needs more than {needed:g} requests "
            f"held (target_ongoing_requests {model.target_ongoing_requests:g} each), but {ingress_max_replicas} "
            f"ingress replica(s) x max_concurrent {max_concurrent} let in {capacity} at most (so at most "
            f"{reachable} replicas); raise max_concurrent or lower max_replicas / target_ongoing_requests")
