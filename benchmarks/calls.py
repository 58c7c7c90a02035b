"""What a Ray actor call carrying a draft tree costs in CPU, the caller's and the callee's: the tree pickled as
lists (``DraftTree.__reduce__``, what crosses between the actors) against torch's own pickling of its tensors.

    .venv/bin/python benchmarks/calls.py [--calls 300] [--rounds 3]

A local Ray with one actor whose ``call`` answers at once with a verdict (no model). Per tree (root-only, 15
nodes greedy, 15 nodes sampled with top-32 dists at its 7 inner nodes) and wire form, ``--calls`` calls back to
back, ``--rounds`` rounds in turn; CPU seconds from each process's user + system time (Ray's own threads
included). Prints the medians over rounds; writes benchmarks/results/calls.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

import torch  # noqa: E402

from sequoia_ray.draft import DraftTree  # noqa: E402
from sequoia_ray.sampling import SparseDist  # noqa: E402
from sequoia_ray.tree.plan import chain, k_ary  # noqa: E402
from sequoia_ray.verify import Verdict  # noqa: E402


class TorchPickled(DraftTree):
    """The same tree pickled as before: its tensors through torch's own reducer."""

    def __reduce__(self):
        return DraftTree, (self.tokens, self.dists, self.plan, self.prefill_beside)


def trees(seed: int = 0) -> dict[str, tuple]:
    """name -> (the plan sent, the tree), as the ingress sends them to the target's rank 0."""
    plan = k_ary(2, 3)
    inner = sorted(set(plan.parents) - {-1})
    g = torch.Generator().manual_seed(seed)
    dists = {i: SparseDist(torch.randperm(150_000, generator=g)[:32], torch.rand(32, generator=g)) for i in inner}
    return {"root-only": (chain(0), DraftTree(torch.tensor([123]), {})),
            f"{plan.n} nodes, greedy": (plan, DraftTree(torch.arange(plan.n), {})),
            f"{plan.n} nodes, sampled ({len(inner)} inner)": (plan, DraftTree(torch.arange(plan.n), dists).to("cpu"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import psutil
    import ray

    @ray.remote
    class Callee:
        def pid(self) -> int:
            return os.getpid()

        def call(self, method: str, request_id: str, *args) -> Verdict:
            return Verdict([0], [5], ((1, 0),), 0, 1)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = Callee.remote()
        callee, me = psutil.Process(ray.get(actor.pid.remote())), psutil.Process()
        cpu = {}
        for _ in range(args.rounds):
            for name, (plan, tree) in trees().items():
                for wire, sent in (("torch", TorchPickled(tree.tokens, tree.dists, tree.plan)), ("lists", tree)):
                    ray.get([actor.call.remote("verify", "r", plan, sent) for _ in range(20)])  # warm
                    before = (me.cpu_times(), callee.cpu_times())
                    for _ in range(args.calls):
                        ray.get(actor.call.remote("verify", "r", plan, sent))
                    after = (me.cpu_times(), callee.cpu_times())
                    ms = [1000 * (b.user + b.system - a.user - a.system) / args.calls for a, b in zip(before, after)]
                    cpu.setdefault((name, wire), []).append(ms)
    finally:
        ray.shutdown()
    rows = [{"tree": name, "pickled as": wire, "caller ms": statistics.median(m[0] for m in runs),
             "callee ms": statistics.median(m[1] for m in runs)} for (name, wire), runs in cpu.items()]
    print_table(rows, ["tree", "pickled as", "caller ms", "callee ms"])
    write_json("calls", {"rows": rows, "args": vars(args) | {"out": str(args.out)}}, args.out)


if __name__ == "__main__":
    main()
