"""The most a tree's shape can gain over a chain on this machine: the best tree against the best chain, predicted.

    .venv/bin/python benchmarks/tree_vs_chain.py [--plan-store .sequoia/plans] [--temperatures 0,0.6]
        [--tokens 96] [--width 8] [--tiny]

Chain speculation (transformers' assisted generation, vLLM's draft-model speculation) proposes one path of k
draft tokens; a tree proposes several. For each temperature and each kind of the profiler's built-in prompts
(code, prose; never ``benchmarks/prompts.jsonl``) this measures the acceptance vector p with the serving pair
(bf16 target, int8 draft, the default draft vocabulary), then takes, by the cost model the profile job plans
with (``hardware.choose`` at batch 1, every n from 1 to ``--max-nodes``; G from the DP over p), the best tree
and the best chain (k = 0 .. ``--max-nodes`` - 1 draft tokens) by their predicted speedup over the target alone,
G / step(n, d). Their ratio is what choosing a tree over a chain can win here at most, before any per-step
overhead or dynamic depth, which chain engines have too. The cost model is this machine's latest hardware
profile in ``--plan-store`` (the main job writes one); on made-up hardware too: the draft's level cost c
scaled by 1/2 and 1/4, and the target's forward as flat as a GPU's (t(n) = 1 up to 64 tokens).

``--tiny`` runs the tiny random pair on a made-up profile: seconds, for the test. Prints a table and writes
``benchmarks/results/tree-vs-chain.json``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.hardware import HardwareProfile, choose  # noqa: E402
from sequoia_ray.tree.acceptance_vector import AcceptanceVector  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.plan import carried_leaf, chain, expected_tokens  # noqa: E402

FLAT_TO = 64  # "GPU-like": a target forward of up to this many tokens costs what one token costs


def best_chain(p: AcceptanceVector, profile: HardwareProfile, max_nodes: int) -> tuple[int, float, float]:
    """(k, G, predicted speedup) of the fastest chain of k draft tokens, k < ``max_nodes``, at batch 1."""
    alone = profile.step_cost(chain(0))

    def row(k: int) -> tuple[int, float, float]:
        plan = chain(k)
        g = expected_tokens(plan, p)
        return k, g, g * alone / profile.step_cost(plan, carried=carried_leaf(plan, p))
    return max((row(k) for k in range(max_nodes)), key=lambda r: r[2])


def compare(p: AcceptanceVector, profile: HardwareProfile, max_nodes: int, max_depth: int) -> dict:
    """The best tree (any n <= ``max_nodes``, depth <= ``max_depth``) against the best chain, predicted at batch 1
    without overhead: a chain is one of the trees the DP weighs, so the ratio is >= 1."""
    best, _ = choose(solve(p, max_nodes, max_depth), profile, budgets=range(1, max_nodes + 1))
    k, g, speedup = best_chain(p, profile, min(max_nodes, max_depth))
    return {"tree n": best.n, "tree d": best.d, "tree G": best.expected_tokens, "tree x target": best.predicted_speedup,
            "chain k": k, "chain G": g, "chain x target": speedup, "tree / chain": best.predicted_speedup / speedup}


def what_ifs(profile: HardwareProfile) -> dict[str, HardwareProfile]:
    """This machine's profile and made-up ones: a cheaper draft level, a target forward as flat as a GPU's."""
    flat = {n: 1.0 for n in range(1, FLAT_TO + 1)}
    return {"this machine": profile,
            "c / 2": replace(profile, c={w: v / 2 for w, v in profile.c.items()}),
            "c / 4": replace(profile, c={w: v / 4 for w, v in profile.c.items()}),
            f"t flat to {FLAT_TO}": replace(profile, t=flat),
            "t flat, c / 4": replace(profile, t=flat, c={w: v / 4 for w, v in profile.c.items()})}


def measured_vectors(pair, temperatures: list[float], tokens: int, width: int) -> dict[tuple[float, str], tuple]:
    """(p, steps) per (temperature, kind) on the profiler's built-in prompts of that kind."""
    from sequoia_ray.acceptance import measure
    from sequoia_ray.profiling import BUILTIN_PROMPTS

    out = {}
    for temperature in temperatures:
        for kind in sorted({p.kind for p in BUILTIN_PROMPTS}):
            prompts = [pair.encode(p.text, chat=p.chat) for p in BUILTIN_PROMPTS if p.kind == kind]
            out[(temperature, kind)] = measure(pair.decoder, prompts, width=width, temperature=temperature,
                                               max_tokens=tokens, progress=False)
    return out


def tiny_profile() -> HardwareProfile:
    """A made-up CPU-like profile for ``--tiny``: t(n) flat to 8 then rising, a draft level 0.2 of a target step."""
    return HardwareProfile("tiny", t={1: 1.0, 8: 1.05, 16: 1.5, 64: 4.0}, c={1: 0.2, 8: 0.21, 64: 0.5},
                           target_step_s=0.1, context=64, dtype="float32")


def latest_profile(store: str) -> HardwareProfile:
    """This machine's newest hardware profile in ``store``."""
    from sequoia_ray.hardware import hardware_id
    from sequoia_ray.plan_store import PlanNotFound, PlanStore

    hw = hardware_id()
    try:
        return PlanStore(store).fetch_profile(hw)
    except PlanNotFound:
        raise SystemExit(f"no hardware profile for {hw} in {store}; run the main job first (bash scripts/main.sh) "
                         "or give --plan-store a store that has one") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-store", default=".sequoia/plans", help="where this machine's hardware profile is")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per prompt while measuring p")
    ap.add_argument("--width", type=int, default=8, help="ranks of p measured (the star tree's width)")
    ap.add_argument("--max-nodes", type=int, default=32, help="largest tree (and longest chain + 1) weighed")
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="the tiny random pair on a made-up profile (seconds)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]

    from sequoia_ray.local import LocalPair

    if args.tiny:
        pair, profile = LocalPair.tiny(device="cpu"), tiny_profile()
    else:
        profile = latest_profile(args.plan_store)
        pair = LocalPair.load(dtype="bfloat16", draft_quantize="int8", progress=False)
    vectors = measured_vectors(pair, temperatures, args.tokens, args.width)
    rows = []
    for (temperature, kind), (p, steps) in vectors.items():
        for hardware, prof in what_ifs(profile).items():
            rows.append({"T": temperature, "kind": kind, "p1": p.rows[0][0], "p2": p.rows[0][1] if p.width > 1 else 0.0,
                         "steps": steps, "hardware": hardware,
                         **compare(p, prof, args.max_nodes, args.max_depth)})
    print_table(rows, ["T", "kind", "p1", "p2", "steps", "hardware", "tree n", "tree d", "tree G", "tree x target",
                       "chain k", "chain G", "chain x target", "tree / chain"])
    write_json("tree-vs-chain" + ("-tiny" if args.tiny else ""),
               {"benchmark": "tree_vs_chain", "profile": profile.hardware_id, "t": profile.t, "c": profile.c,
                "tokens": args.tokens, "width": args.width, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
