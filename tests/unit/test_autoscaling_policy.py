"""The model deployments' autoscaling policy: replicas = ceil(held requests / target), within bounds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deployments.autoscaling import HELD, POLICY, autoscaling_config, held_requests_policy


def ctx(held: dict, target: float = 4, low: int = 1, high: int = 4):
    return SimpleNamespace(aggregated_metrics={HELD: held} if held is not None else {},
                           capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=high,
                           config=SimpleNamespace(target_ongoing_requests=target))


@pytest.mark.parametrize("held,expected", [
    (None, 1),                      # no replica has reported yet
    ({"a": 0.0}, 1),
    ({"a": 3.5}, 1),
    ({"a": 4.0, "b": 0.5}, 2),      # summed over replicas (a new one reports 0)
    ({"a": 8.0, "b": 8.0}, 4),
    ({"a": 40.0}, 4),               # capped at the maximum
])
def test_policy_sizes_on_held_requests(held, expected):
    replicas, state = held_requests_policy(ctx(held))
    assert replicas == expected and state["held_requests"] == sum((held or {}).values())


def test_minimum_holds_when_idle():
    assert held_requests_policy(ctx({"a": 0.0}, low=2))[0] == 2


def test_policy_is_injected_unless_named():
    assert autoscaling_config({"max_replicas": 3})["policy"] == {"policy_function": POLICY}
    mine = {"policy": {"policy_function": "x:y"}}
    assert autoscaling_config(mine)["policy"] == mine["policy"]
    from ray.serve.config import AutoscalingConfig

    assert AutoscalingConfig(**autoscaling_config({"max_replicas": 3})).policy.policy_function == POLICY


def test_the_ingress_scales_to_carry_the_models_max():
    from deployments.autoscaling import INGRESS_HEADROOM, check_reachable, ingress_autoscaling_config

    user = {"min_replicas": 2, "initial_replicas": 3, "max_replicas": 4, "target_ongoing_requests": 8,
            "upscale_delay_s": 5, "policy": {"policy_function": "x:y"}}
    ingress = ingress_autoscaling_config(user, 16)
    per_replica = INGRESS_HEADROOM * 16  # 12 requests per ingress replica before Serve adds one
    assert ingress == {"min_replicas": 2, "initial_replicas": 2, "max_replicas": 3, "upscale_delay_s": 5,
                       "target_ongoing_requests": per_replica,  # ceil(16/12), ceil(24/12), ceil(32/12)
                       "policy": {"policy_function": POLICY}}  # on its generations in flight, not the user's
    check_reachable(user, ingress["max_replicas"], 16)
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**ingress)  # a valid Serve config
    assert ingress_autoscaling_config({"min_replicas": 0, "max_replicas": 1}, 8)["min_replicas"] == 1  # /health


def test_a_max_the_ingress_cannot_let_in_is_refused_naming_the_fix():
    from deployments.autoscaling import check_reachable

    user = {"max_replicas": 4, "target_ongoing_requests": 8}
    with pytest.raises(ValueError, match=r"max_replicas 4 is unreachable: it needs more than 24 requests held .* "
                                         r"1 ingress replica\(s\) x max_concurrent 16 let in 16 at most \(so at most "
                                         r"2 replicas\); raise max_concurrent"):
        check_reachable(user, 1, 16)
    check_reachable(user, 1, 25)  # 25 held: ceil(25 / 8) = 4


def test_the_ingress_reports_its_generations_in_flight_not_its_calls():
    """One Serve call may run a batch of prompts or n choices: Serve's count of calls saw a replica full of
    batches (4 calls of 4 prompts, max_concurrent 16) as a quarter busy, and never added one."""
    import asyncio

    from deployments.ingress import OpenAIIngress
    from sequoia_ray.in_flight import InFlight

    class Held(OpenAIIngress.func_or_class):  # made without its constructor: no __del__ to run
        def __del__(self) -> None:
            pass

    replica = object.__new__(Held)
    replica.in_flight = InFlight(0.0)
    for _ in range(16):
        replica.in_flight.enter()
    assert asyncio.run(replica.record_autoscaling_stats()) == {HELD: 16.0}
    assert held_requests_policy(ctx({"a": 16.0}, target=12, high=3))[0] == 2
