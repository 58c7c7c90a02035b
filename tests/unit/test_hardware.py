"""The optimizer picks the known best (n, d) on synthetic t(n) and c; profiles round-trip and validate."""

from __future__ import annotations

import json

import pytest
import torch

from sequoia_ray.hardware import (HardwareProfile, ProfileError, batch_bucket, choose, hardware_id, per_request_sizes,
                                  profile, time_batched, time_forward, time_steps)
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan import chain
from tests.tiny import tiny_model


def synthetic(t: dict[int, float], c: float) -> HardwareProfile:
    return HardwareProfile("test-hw", t, {w: c for w in (1, 2, 4, 8, 16, 32, 64)}, 0.1, 128, "float32")


def brute_force_best(table, prof, budgets):
    best = None
    for n in budgets:
        for d in range(1, table.max_depth + 1):
            plan = table.tree(n, d)
            levels = plan.num_levels
            cost = prof.t_of(plan.n) + prof.c_of(1) * (levels - 1)  # constant c: (levels - 1) draft forwards
            s = table.value(n, d) / cost
            if best is None or s > best[0] + 1e-12:
                best = (s, n, d)
    return best


def test_flat_t_and_free_draft_picks_the_biggest_deepest_tree():
    table = solve(AcceptanceVector.from_p([0.8, 0.1]), 64, 8)
    prof = synthetic({n: 1.0 for n in (1, 2, 4, 8, 16, 32, 64)}, c=1e-9)
    best, _ = choose(table, prof, budgets=(1, 2, 4, 8, 16, 32, 64))
    assert (best.n, best.d) == (64, 8)


def test_expensive_verification_picks_small_trees():
    table = solve(AcceptanceVector.from_p([0.8, 0.1]), 64, 8)
    prof = synthetic({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0, 32: 32.0, 64: 64.0}, c=0.01)  # t(n) = n
    best, _ = choose(table, prof, budgets=(1, 2, 4, 8, 16, 32, 64))
    assert best.n == 1 and best.predicted_speedup == pytest.approx(1 / 1.0)


@pytest.mark.parametrize("c", [0.02, 0.1, 0.3])
def test_choice_matches_brute_force_on_a_realistic_curve(c):
    table = solve(AcceptanceVector.from_p([0.72, 0.09, 0.04, 0.02]), 64, 10)
    t = {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.15, 16: 1.4, 32: 2.0, 64: 3.3}
    budgets = (1, 2, 4, 8, 16, 32, 64)
    prof = synthetic(t, c)
    best, candidates = choose(table, prof, budgets=budgets)
    s, n, d = brute_force_best(table, prof, budgets)
    assert best.predicted_speedup == pytest.approx(s, rel=1e-12)
    assert len(candidates) == len(budgets) * 10
    assert best.predicted_speedup == max(x.predicted_speedup for x in candidates)


def test_profile_round_trip_and_validation(tmp_path):
    prof = synthetic({1: 1.0, 8: 1.2}, c=0.2)
    path = tmp_path / "p.json"
    prof.save(path)
    assert HardwareProfile.load(path) == prof
    bad = json.loads(path.read_text())
    bad["t"]["4"] = float("nan")
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="field 't'"):
        HardwareProfile.load(path)
    with pytest.raises(ProfileError, match="profiled max 8"):
        prof.t_of(16)
    for table in ("t", "c"):  # without size 1 a table reads flat below its smallest size: every ratio off
        bad = prof.to_dict()
        del bad[table]["1"]
        with pytest.raises(ProfileError, match="must hold size 1"):
            HardwareProfile.from_dict(bad)


def test_time_forward_on_a_tiny_model_and_hardware_id():
    times = time_forward(tiny_model("llama"), (1, 4), context=16, repeats=2, warmup=1)
    assert set(times) == {1, 4} and all(v > 0 for v in times.values())
    assert hardware_id().startswith("cpu-") and hardware_id().endswith("c")
    assert hardware_id("H100", 2) == "H100-tp2" and hardware_id("L4") == "L4"


ARM_CPUINFO = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd\nCPU implementer\t: {}\nCPU part\t: {}\n\n"


@pytest.mark.parametrize("implementer, part, model", [
    ("0x41", "0xd0c", "Neoverse-N1"),  # Graviton2, Ampere Altra
    ("0x41", "0xd40", "Neoverse-V1"),  # Graviton3
    ("0x41", "0xd4f", "Neoverse-V2"),  # Graviton4, Grace
    ("0x41", "0xd99", "arm-0x41-0xd99"),  # a core the table does not know: still its own
])
def test_arm_cpus_are_told_apart_by_their_core(implementer, part, model):
    """/proc/cpuinfo names no model on Arm Linux: every Arm CPU was ``aarch64`` (torch's capability ``default``
    alike on several), so one's plans were served on another."""
    import sequoia_ray.hardware as hardware

    assert hardware._cpu_model(ARM_CPUINFO.format(implementer, part)) == model
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
    assert hardware._cpu_model(x86) == "AMD-EPYC-9R14-96-Core-Processor"


def test_cpu_hardware_ids_tell_vector_instruction_sets_apart(monkeypatch):
    """Plans are per CPU kind: the same model name with other kernels (AVX2 against AVX-512 bf16) is another
    id, and an id computed away from the target (its deployment replica) uses the target's CPU."""
    import sequoia_ray.hardware as hardware

    isa = torch.backends.cpu.get_cpu_capability().lower().replace(" ", "")
    assert hardware.cpu_name().removesuffix("bf16").endswith(f"-{isa}")
    assert hardware_id(None, 1, 2) == f"cpu-{hardware.cpu_name()}-2c"
    assert hardware_id(None, 2, 4, cpu="Other-CPU-avx512bf16") == "cpu-Other-CPU-avx512bf16-4c-tp2"
    ids = set()
    for capability, bf16 in [("AVX2", False), ("AVX512", False), ("AVX512", True)]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda b=bf16: b)
        ids.add(hardware_id(None, 1, 2))
    assert len(ids) == 3, ids


GPU_NAMES = {"NVIDIA A100-SXM4-80GB": "A100", "NVIDIA A100 80GB PCIe": "A100", "NVIDIA H100 80GB HBM3": "H100",
             "NVIDIA L4": "L4", "Tesla V100-SXM2-16GB": "V100", "Tesla T4": "T4", "NVIDIA A10G": "A10G",
             "NVIDIA RTX PRO 6000 Blackwell Server Edition": "RTX-PRO-6000",
             "NVIDIA GeForce RTX 4090": "GeForce-RTX-4090", "NVIDIA TITAN RTX": "TITAN-RTX"}


@pytest.mark.parametrize("name", sorted(GPU_NAMES))
def test_a_gpu_is_named_as_ray_labels_its_node(name):
    """The Tune job files a GPU type's plans under its node's ``accelerator_type:<type>`` resource, which Ray
    derives from the device name; serving and ``sequoia-ray profile`` name the GPU from torch's device name. Both
    must give one id, or serving never finds the job's plans. Checked against the Ray installed here."""
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    from sequoia_ray.hardware import gpu_type

    assert gpu_type(name) == GPU_NAMES[name]
    assert gpu_type(name) == NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(name)


def test_serving_and_the_tune_job_give_one_gpu_one_hardware_id(monkeypatch):
    """No GPU here: torch's device name is stubbed; the id serving computes in the target actor (accelerator_name
    of its device) equals the one the Tune job publishes under (the node resource's type)."""
    from sequoia_ray.hardware import accelerator_name
    from tuning.profile import discover_hardware

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    (job_type,) = discover_hardware({"CPU": 8, "GPU": 4, "accelerator_type:A100": 4})
    assert hardware_id(accelerator_name(torch.device("cuda", 0)), 2) == hardware_id(job_type, 2) == "A100-tp2"
    assert accelerator_name(torch.device("cpu")) is None


# ---- batches -----------------------------------------------------------------------------------------
BUDGETS = (1, 2, 4, 8, 16, 32, 64)


def batched(per_token: float, fixed: float = 1.0, draft: float = 0.05) -> HardwareProfile:
    """T_B(N) = fixed + per_token x N for every batch (a forward reads the weights once, then pays per token),
    C_B(W) = draft x T_B(W): speculation's extra tokens cost more the more requests share the forward."""
    def row(b: int, scale: float) -> dict[int, float]:
        return {b * s: scale * (fixed + per_token * b * s) for s in BUDGETS if b * s <= 64 or s == 1}

    base = {n: fixed + per_token * n for n in BUDGETS}
    norm = base[1]
    return HardwareProfile("test-hw", {n: v / norm for n, v in base.items()},
                           {w: draft * v / norm for w, v in base.items()}, 0.1, 128, "float32",
                           batch_t={b: {k: v / norm for k, v in row(b, 1.0).items()} for b in (2, 4, 8, 16)},
                           batch_c={b: {k: v / norm for k, v in row(b, draft).items()} for b in (2, 4, 8, 16)})


def by_hand(table, prof, batch, n, d) -> float:
    """B·G / step(B, n, d) from the profile's tables, level by level (no helper of the module); the first level
    also forwards the last tree's accepted leaf: the chance the accepted path ends at a leaf below the root."""
    plan = table.tree(n, d)
    p = table.acceptance

    def accepted(node: int) -> float:
        if node == 0:
            return 1.0
        parent = plan.parents[node]
        return accepted(parent) * p.row(plan.depth[parent])[plan.rank[node] - 1]

    carried = sum(accepted(i) for i in range(1, plan.n) if not plan.children[i])
    step = prof.target_cost(batch, batch * plan.n)
    for k, level in enumerate(plan.levels):
        inner = sum(1 for node in level if plan.children[node])
        if inner:
            step += prof.level_cost(batch, batch * (inner + (carried if k == 0 else 0)))
    return batch * table.value(n, d) / step


def test_the_tree_shrinks_as_the_batch_grows():
    table = solve(AcceptanceVector.from_p([0.72, 0.09, 0.04, 0.02]), 64, 10)
    prof = batched(per_token=0.02)
    chosen = {b: choose(table, prof, BUDGETS, batch=b)[0] for b in (1, 2, 4, 8, 16)}
    ns = [chosen[b].n for b in (1, 2, 4, 8, 16)]
    assert ns == sorted(ns, reverse=True) and ns[0] > ns[-1], ns
    for b, best in chosen.items():
        assert best.batch == b
        alone = b / prof.target_cost(b, b)  # the target alone batched: b tokens per T_B(b)
        assert best.throughput == pytest.approx(by_hand(table, prof, b, best.n, best.d), rel=1e-12)
        assert best.predicted_speedup == pytest.approx(best.throughput / alone, rel=1e-12)
        best_by_hand = max(by_hand(table, prof, b, n, d) for n in BUDGETS if b * n <= prof.max_tokens(b)
                           for d in range(1, 11))
        assert best.throughput == pytest.approx(best_by_hand, rel=1e-12)


def test_the_root_only_tree_wins_where_speculation_cannot_pay():
    """Per-token cost so high that at batch 16 (16 x n tokens) any tree costs more than it brings; at batch 1
    the fixed cost still dominates and a tree pays."""
    table = solve(AcceptanceVector.from_p([0.6, 0.1]), 64, 8)
    prof = batched(per_token=0.1, draft=0.3)
    small, big = (choose(table, prof, BUDGETS, batch=b)[0] for b in (1, 16))
    assert small.n > 1 and small.predicted_speedup > 1
    assert (big.n, big.plan.n, big.predicted_speedup) == (1, 1, 1.0)
    assert big.step_cost == prof.target_cost(16, 16)  # no draft call at all


def test_batch_one_ignores_the_batch_tables():
    table = solve(AcceptanceVector.from_p([0.72, 0.09, 0.04, 0.02]), 64, 10)
    prof = batched(per_token=0.02)
    old = HardwareProfile(prof.hardware_id, prof.t, prof.c, prof.target_step_s, prof.context, prof.dtype)
    assert choose(table, prof, BUDGETS)[0] == choose(table, old, BUDGETS)[0]
    assert choose(table, prof, BUDGETS)[0] == choose(table, prof, BUDGETS, batch=1)[0]


def test_a_profile_without_batch_tables_extrapolates_one_long_request(tmp_path):
    prof = synthetic({1: 1.0, 8: 1.2, 64: 3.0}, c=0.2)
    assert prof.buckets() == (1, 2, 4, 8, 16)
    assert prof.target_cost(4, 32) == prof.t_of(32) and prof.level_cost(4, 8) == prof.c_of(8)
    assert prof.max_tokens(16) == 64  # t's largest size: n <= 4 at batch 16
    (tmp_path / "old.json").write_text(json.dumps({k: v for k, v in prof.to_dict().items()
                                                   if k not in ("batch_t", "batch_c")}))  # a file of before
    assert HardwareProfile.load(tmp_path / "old.json") == prof


def test_a_batchs_trees_are_bounded_by_the_targets_reach_and_their_levels_by_the_drafts():
    """A profile without batch tables (a tensor-parallel group's), t to 256 tokens and c to 64 wide: a batch's
    tree tokens were capped at c's 64 too, so batch 16 could plan no tree of more than 4 nodes however narrow
    its levels; each level is still held to c's reach (``can_cost``)."""
    from sequoia_ray.hardware import DEFAULT_BUDGETS, DRAFT_WIDTHS, draft_widths

    t = {n: 1 + 0.002 * (n - 1) for n in DEFAULT_BUDGETS}  # a GPU's nearly flat t(n)
    prof = HardwareProfile("gpu-tp2", t, {w: 0.05 + 0.0005 * (w - 1) for w in DRAFT_WIDTHS}, 0.02, 256, "bfloat16")
    table = solve(AcceptanceVector.from_p([0.75, 0.1, 0.04, 0.02, 0.01, 0.01]), 256, 12)
    assert [prof.max_tokens(b) for b in (1, 4, 16)] == [256, 256, 256]
    best, candidates = choose(table, prof, DEFAULT_BUDGETS, batch=16)
    assert best.n > 4 and prof.can_cost(best.plan, 16, best.carried)
    assert all(16 * max(draft_widths(c.plan, c.carried), default=0) <= 64 for c in candidates)
    assert any(c.n * 16 > 64 for c in candidates)


def test_batch_tables_round_trip_and_validation(tmp_path):
    prof = batched(per_token=0.02)
    path = tmp_path / "p.json"
    prof.save(path)
    assert HardwareProfile.load(path) == prof and prof.buckets() == (1, 2, 4, 8, 16)
    bad = json.loads(path.read_text())
    bad["batch_t"]["4"]["8"] = -1.0
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"field 'batch_t\[4\]'"):
        HardwareProfile.load(path)
    with pytest.raises(ProfileError, match="batch 3 not profiled"):
        prof.target_cost(3, 6)
    with pytest.raises(ProfileError, match="profiled max 64"):
        prof.target_cost(16, 128)


@pytest.mark.parametrize("size, bucket", [(1, 1), (2, 2), (3, 2), (5, 4), (8, 8), (15, 8), (16, 16), (40, 16)])
def test_batch_bucket_is_the_largest_bucket_not_above(size, bucket):
    assert batch_bucket(size) == bucket


def test_batch_bucket_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="batch size 0 must be >= 1"):
        batch_bucket(0)


def test_time_batched_on_a_tiny_model():
    model = tiny_model("llama")
    assert per_request_sizes(4, (1, 2, 4, 8), 8) == (1, 2)
    assert per_request_sizes(16, (2, 4, 8), 8) == (1,)  # the target alone batched, always
    times = time_batched(model, 4, (1, 2), context=16, repeats=2, warmup=1)
    assert set(times) == {4, 8} and all(v > 0 for v in times.values())


def test_profile_times_every_bucket_on_tiny_models():
    target, draft = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    prof = profile(target, draft, hardware="test-hw", budgets=(1, 2, 4), widths=(1, 2, 4), context=8, repeats=1,
                   batches=(1, 2, 4, 8))
    assert set(prof.batch_t) == set(prof.batch_c) == {2, 4, 8} and prof.buckets() == (1, 2, 4, 8)
    assert set(prof.batch_t[2]) == {2, 4} and set(prof.batch_t[8]) == {8}  # B·s <= 4 for s = 1, 2; s = 1 always
    assert prof.max_tokens(8) == 8


def test_time_steps_runs_the_batched_forwards_of_a_step():
    from sequoia_ray.tree.plan import chain, k_ary

    target, draft = tiny_model("llama", seed=1), tiny_model("llama", seed=2)
    times = time_steps(target, draft, [k_ary(2, 2), chain(0)], 4, context=8, repeats=1)
    assert len(times) == 2 and all(v > 0 for v in times)
    assert time_steps(target, None, [chain(0)], 4, context=8, repeats=1)[0] > 0  # root-only: no draft call


def test_a_batch_beyond_its_timed_grid_carries_its_excess_over_one_request():
    """Batch 4 timed at 4 and 8 tokens only (a bounded profile): beyond 8, t(N) + (T_4(8) - t(8))."""
    t = {1: 1.0, 4: 1.1, 8: 1.3, 16: 2.0, 32: 3.5}
    c = {w: 0.1 * v for w, v in t.items()}
    prof = HardwareProfile("test-hw", t, c, 0.1, 64, "float32", batch_t={4: {4: 1.4, 8: 1.7}},
                           batch_c={4: {4: 0.2, 8: 0.25}})
    assert prof.target_cost(4, 6) == pytest.approx(1.55)  # inside the grid: interpolated
    assert prof.target_cost(4, 16) == pytest.approx(2.0 + 0.4) and prof.target_cost(4, 32) == pytest.approx(3.9)
    assert prof.level_cost(4, 16) == pytest.approx(0.2 + 0.12)
    assert prof.max_tokens(4) == 32 and prof.buckets() == (1, 4)
    low = HardwareProfile("test-hw", t, c, 0.1, 64, "float32", batch_t={4: {4: 1.0, 8: 1.2}}, batch_c={4: {4: 0.1}})
    assert low.target_cost(4, 16) == pytest.approx(2.0 - 0.1)  # a batch cheaper than one long request stays so
    assert low.target_cost(4, 12) >= low.target_cost(4, 8)  # ... but more tokens never cost less


def test_profile_takes_each_forward_at_its_fastest_repeat(monkeypatch):
    """A slow phase of a shared host in two of three repeats of t(1) (the 2-core Xeon: 411, 382, 171 ms) must not
    become the machine's t(1), which every table is divided by; the noise and drift are still judged on all."""
    import sequoia_ray.hardware as hw

    samples = {("t", 1, 1): [0.411, 0.382, 0.171], ("t", 1, 8): [0.19, 0.2, 0.4], ("c", 1, 1): [0.05, 0.06, 0.05],
               ("t", 2, 2): [0.18, 0.4, 0.18], ("c", 2, 2): [0.06, 0.06, 0.07]}
    monkeypatch.setattr(hw, "_time_all", lambda *a, **kw: {k: list(v) for k, v in samples.items()})
    prof = hw.profile(object(), object(), hardware="test-hw", budgets=(1, 8), widths=(1,), context=8, repeats=3,
                      batches=(2,))
    assert prof.target_step_s == 0.171
    assert prof.t == pytest.approx({1: 1.0, 8: 0.19 / 0.171}) and prof.c == pytest.approx({1: 0.05 / 0.171})
    assert prof.batch_t == {2: pytest.approx({2: 0.18 / 0.171})}
    assert prof.batch_c == {2: pytest.approx({2: 0.06 / 0.171})}
    assert prof.noise == pytest.approx(hw.relative_noise(samples))
    assert prof.drift == pytest.approx(hw.round_drift(samples))
    assert hw.quiet([0.3, 0.1, 0.2]) == 0.1 and hw.quiet(iter([2.0, 1.5])) == 1.5


def test_the_carried_leaf_can_make_the_target_alone_the_choice():
    """A dear draft level of two tokens (c(1) = 0.3, c(2) = 1.0) and a flat target: the one-token chain's G is 1.5
    for 1.3 target steps without its carried leaf (1.15x), but its leaf, accepted half the time, widens the next
    step's first draft level to 1.5 tokens: c(1.5) = 0.65, 1.5 / 1.65 = 0.91x. The target alone is chosen."""
    table = solve(AcceptanceVector.from_p([0.5]), 8, 4)
    prof = HardwareProfile("test-hw", {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, {1: 0.3, 2: 1.0, 4: 2.0, 8: 4.0}, 0.1, 64,
                           "float32")
    one = table.tree(2, 2)
    assert table.value(2, 2) / prof.step_cost(one) == pytest.approx(1.5 / 1.3)  # without the carried leaf
    best, candidates = choose(table, prof, (1, 2, 4, 8))
    chain_one = next(c for c in candidates if c.plan == one)
    assert chain_one.carried == pytest.approx(0.5) and chain_one.step_cost == pytest.approx(1.65)
    assert chain_one.predicted_speedup == pytest.approx(1.5 / 1.65)
    assert (best.n, best.predicted_speedup) == (1, 1.0)
    assert prof.draft_cost(chain(0), carried=0.9) == 0.0  # the root-only tree runs no draft, whatever it is given


def test_a_tree_with_a_level_wider_than_the_profiled_draft_is_no_candidate():
    """t profiled to 256 nodes, c only to 64 wide: at batch 1 some trees of 256 nodes for this vector have levels
    66 wide. choose raised ProfileError ("c(w) at 66.0 > profiled max 64") and so crashed serving's per-request
    trees, the live re-plan and the trials; now such a tree is no candidate, as a budget beyond t is none."""
    from sequoia_ray.hardware import DEFAULT_BUDGETS, DRAFT_WIDTHS, choose_buckets

    def widest(choice) -> float:  # the widest draft forward of the step, the carried leaf included
        inner = [sum(1 for node in level if choice.plan.children[node]) for level in choice.plan.levels]
        return max([i + choice.carried * (k == 0) for k, i in enumerate(inner) if i], default=0.0)

    prof = HardwareProfile("test-hw", {n: 1.0 for n in DEFAULT_BUDGETS}, {w: 0.01 for w in DRAFT_WIDTHS}, 0.1, 256,
                           "float32")
    table = solve(AcceptanceVector.from_p([0.5, 0.3, 0.2]), 256, 12)
    best, candidates = choose(table, prof)
    assert all(widest(c) <= 64 for c in candidates)
    assert len(candidates) < len(DEFAULT_BUDGETS) * 12  # some wide trees were left out ...
    assert any(c.n == 256 for c in candidates)  # ... but not every tree of the largest budget
    assert best.predicted_speedup == max(c.predicted_speedup for c in candidates) > 1
    assert set(choose_buckets(table, prof)) == set(prof.buckets())


@pytest.mark.parametrize("name, expected", [("AMD Instinct MI250X/MI250", "AMD-Instinct-MI250X-MI250"),
                                            ("Some GPU (rev 2)", "Some-GPU--rev-2-"), ("NVIDIA ..", "unknown-gpu")])
def test_a_gpu_name_with_characters_no_folder_holds_is_sanitised(name, expected):
    """A device name with '/' (an AMD Instinct) became a hardware id the plan store refuses, so serving could
    neither find nor publish its plans; the characters outside [A-Za-z0-9._-] become '-'."""
    from sequoia_ray.hardware import gpu_type
    from sequoia_ray.plan_store import PlanKey

    assert gpu_type(name) == expected
    assert PlanKey(hardware_id(gpu_type(name), 2), "d", "t", 0.0).folder().startswith(f"plans/{expected}-tp2/")
