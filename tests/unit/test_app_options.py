"""The Serve options ``build_app`` gives each deployment, read from the bound application without Ray: the
ingress gets the models' drain time to finish its streams, and scales so the models' max_replicas is reachable."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deployments.app import build_app
from deployments.autoscaling import HELD, POLICY, held_requests_policy

# k8s/rayservice.yaml's scaling: 4 model replicas at 8 held requests each, 16 requests per ingress replica
K8S = {"draft": None, "max_concurrent": 16, "autoscaling": {"min_replicas": 1, "max_replicas": 4,
                                                            "target_ongoing_requests": 8}}


def deployments(args: dict) -> dict:
    """Deployment name -> its Serve deployment config, for the application ``build_app(args)`` binds."""
    ingress = build_app(args)._bound_deployment
    found = {ingress.name: ingress._deployment_config}
    for arg in ingress.init_args[1:]:
        if arg is not None:
            found[arg._bound_deployment.name] = arg._bound_deployment._deployment_config
    return found


@pytest.mark.parametrize("args", [{"drain_timeout_s": 123.0}, {**K8S, "drain_timeout_s": 123.0}])
def test_the_ingress_drains_as_long_as_the_models(args):
    """The ingress runs every request's decoding loop: Serve's default 20 s would cut streams on a redeploy."""
    configs = deployments(args)
    assert {name: c.graceful_shutdown_timeout_s for name, c in configs.items()} == {
        name: 123.0 for name in configs}


def test_the_models_max_replicas_is_reachable_through_the_ingress():
    configs = deployments(K8S)
    ingress, target = configs["OpenAIIngress"], configs["TargetDeployment"]
    scaling = ingress.autoscaling_config
    assert scaling is not None, "a fixed ingress caps the held requests at num_replicas x max_concurrent"
    most_held = scaling.max_replicas * K8S["max_concurrent"]  # every ingress replica full
    ctx = SimpleNamespace(aggregated_metrics={HELD: {"r": float(most_held)}}, capacity_adjusted_min_replicas=1,
                          capacity_adjusted_max_replicas=target.autoscaling_config.max_replicas,
                          config=target.autoscaling_config)
    assert held_requests_policy(ctx)[0] == 4
    assert scaling.target_ongoing_requests < K8S["max_concurrent"]  # it scales up before a replica refuses
    assert scaling.policy.policy_function == POLICY  # on its generations in flight: a call may be a batch
    assert scaling.min_replicas == 1


def test_without_autoscaling_the_ingress_keeps_num_replicas():
    configs = deployments({"num_replicas": 2})
    assert {name: (c.num_replicas, c.autoscaling_config) for name, c in configs.items()} == {
        name: (2, None) for name in configs}
