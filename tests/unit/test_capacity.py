"""A configuration the cluster can never place fails at deploy time, naming the resource and the fix."""

import pytest

from deployments.capacity import Demand, Unplaceable, check_placeable

TWO_CPU = [{"CPU": 2.0, "memory": 8e9}]


def demands(num_cpus: float, tp: int = 1, gpus: float = 0.0, strategy: str = "PACK", accel: str | None = None):
    actor = {"CPU": num_cpus, **({"GPU": gpus} if gpus else {}), **({f"accelerator_type:{accel}": 0.001} if accel else {})}
    return [Demand("DraftDeployment", (dict(actor),), strategy),
            Demand("TargetDeployment", tuple(dict(actor) for _ in range(tp)), strategy)]


def test_one_cpu_per_model_actor_fits_two_cores():
    check_placeable(demands(1.0), TWO_CPU)


def test_more_cpus_than_the_machine_names_the_total_and_the_fix():
    with pytest.raises(Unplaceable, match=r"needs 4 CPU in all \(DraftDeployment 2 \+ TargetDeployment 2\) but "
                                          r"the cluster has 2; lower num_cpus"):
        check_placeable(demands(2.0), TWO_CPU)


def test_a_bundle_larger_than_every_node():
    with pytest.raises(Unplaceable, match="needs 3 CPU on one node.*largest node has 2"):
        check_placeable(demands(3.0), TWO_CPU + TWO_CPU)


def test_strict_pack_needs_one_node_for_all_bundles():
    check_placeable(demands(1.0, tp=2), TWO_CPU + TWO_CPU)  # PACK may spread the two ranks
    with pytest.raises(Unplaceable, match="TargetDeployment needs 2 GPU on one node for its 2 bundles together"):
        check_placeable(demands(1.0, tp=2, gpus=1.0, strategy="STRICT_PACK"),
                        [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}])


def test_missing_gpu_and_accelerator_type():
    with pytest.raises(Unplaceable, match="GPU.*num_gpus: 0 and device: cpu"):
        check_placeable(demands(1.0, gpus=1.0), TWO_CPU)
    with pytest.raises(Unplaceable, match="accelerator_type:A100.*a type the cluster has"):
        check_placeable(demands(1.0, gpus=1.0, accel="A100"), [{"CPU": 8.0, "GPU": 2.0, "accelerator_type:L4": 1.0}])


def test_resources_on_different_nodes_but_never_together():
    """Each resource on some node, none with them all: a StopIteration with no message before (Serve's
    DEPLOY_FAILED said nothing)."""
    gpu_node, cpu_node = {"CPU": 1.0, "GPU": 4.0, "accelerator_type:A100": 1.0}, {"CPU": 8.0}
    with pytest.raises(Unplaceable, match=r"needs 2 CPU, 1 GPU, 0.001 accelerator_type:A100 on one node for one of "
                                          r"its bundles: some node has each of them, none has them all"):
        check_placeable(demands(2.0, gpus=1.0, accel="A100"), [gpu_node, cpu_node])


def test_the_replicas_serve_starts_are_the_initial_ones():
    from deployments.app import demands as app_demands
    from deployments.config import ServeConfig
    from deployments.launch import DEFAULT_CONFIG, app_args

    cfg = ServeConfig.model_validate(app_args(DEFAULT_CONFIG, []))
    bounds = {"min_replicas": 1, "max_replicas": 3}
    assert [d.replicas for d in app_demands(cfg.model_copy(update={"autoscaling": bounds}))] == [1, 1]
    three = cfg.model_copy(update={"autoscaling": {**bounds, "initial_replicas": 3}})
    assert [d.replicas for d in app_demands(three)] == [3, 3]
    with pytest.raises(Unplaceable, match="needs 6 CPU in all"):  # passed before: min_replicas 1 was checked
        check_placeable(app_demands(three), TWO_CPU)
    assert [d.replicas for d in app_demands(cfg.model_copy(update={"autoscaling": {"min_replicas": 0}}))] == [1, 1]


def test_replicas_multiply_the_demand():
    ok = [Demand("TargetDeployment", ({"CPU": 1.0},), replicas=2)]
    check_placeable(ok, TWO_CPU)
    with pytest.raises(Unplaceable, match="needs 3 CPU in all"):
        check_placeable([Demand("TargetDeployment", ({"CPU": 1.0},), replicas=3)], TWO_CPU)


def test_the_shipped_config_fits_a_two_core_machine():
    from deployments.app import demands as app_demands
    from deployments.config import ServeConfig
    from deployments.launch import DEFAULT_CONFIG, app_args

    cfg = ServeConfig.model_validate(app_args(DEFAULT_CONFIG, []))
    check_placeable(app_demands(cfg), TWO_CPU)
    with pytest.raises(Unplaceable, match="needs 4 CPU in all"):
        check_placeable(app_demands(cfg.model_copy(update={"num_cpus": 2.0})), TWO_CPU)
    tp2 = cfg.model_copy(update={"tp_size": 2, "num_gpus": 1.0})
    assert [d.bundles for d in app_demands(tp2)] == [({"CPU": 1.0, "GPU": 1.0},), ({"CPU": 1.0, "GPU": 1.0},) * 2]
    assert app_demands(cfg.model_copy(update={"draft": None}))[0].deployment == "TargetDeployment"


def test_replicas_must_pack_onto_the_nodes_together():
    """Three 2-GPU STRICT_PACK groups on two 3-GPU nodes: each fits a node and 6 GPUs fit the cluster, but a
    node holds one group only (its third GPU is no use to another), so the third replica would wait for ever."""
    from deployments.app import demands as app_demands
    from deployments.config import ServeConfig

    cfg = ServeConfig(draft=None, tp_size=2, tp_backend="nccl", num_gpus=1, num_replicas=3)
    nodes = [{"CPU": 8.0, "GPU": 3.0}, {"CPU": 8.0, "GPU": 3.0}]
    with pytest.raises(Unplaceable, match=r"deployment TargetDeployment cannot place all its replicas.*\(its 2 CPU, "
                                          r"2 GPU find no node with room left once the others are placed\); lower "
                                          r"num_replicas"):
        check_placeable(app_demands(cfg), nodes)
    check_placeable(app_demands(cfg.model_copy(update={"num_replicas": 2})), nodes)
    check_placeable(app_demands(cfg), nodes + [{"CPU": 8.0, "GPU": 2.0}])


def test_packing_backtracks_before_refusing():
    """First-fit decreasing puts both 4-CPU bundles on one 10-CPU node and then finds no room for the last
    3-CPU one; a placement exists (4 + 3 + 3 on each node), so the deploy goes ahead."""
    bundles = tuple({"CPU": cpus} for cpus in (4.0, 4.0, 3.0, 3.0, 3.0, 3.0))
    check_placeable([Demand("TargetDeployment", bundles)], [{"CPU": 10.0}, {"CPU": 10.0}])
    check_placeable([Demand("A", ({"CPU": 1.0}, {"CPU": 1.0}), "STRICT_PACK", 2), Demand("B", ({"CPU": 1.0},))],
                    [{"CPU": 2.0}, {"CPU": 3.0}])  # a 2-CPU group per node, B on the third CPU
    with pytest.raises(Unplaceable, match="cannot place all its replicas"):
        check_placeable([Demand("A", ({"CPU": 2.0},), "STRICT_PACK", 3)], [{"CPU": 3.0}, {"CPU": 3.0}])
