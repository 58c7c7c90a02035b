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
