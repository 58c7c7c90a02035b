"""What a served step's actor calls cost, without the models: the cost model's ``calls`` overhead term.

Two idle actors stand in for the draft actor and the target's rank 0 and answer at once; a step is timed as
the ingress makes it — with a tree: ``grow`` (two returns: a flag the caller waits on and the tree, handed to
the target by reference) then ``verify`` of that reference; the target alone: one ``verify`` of a root-only
tree. The tree is a ``DraftTree`` of host tensors of the plan's size (with its D at every inner node when
sampled), so serialisation is paid as served. What it cannot see: the models' threads competing for the
cores with the actors' (measured by ``benchmarks/serve.py`` against in process).
"""

from __future__ import annotations

import statistics
import time

import ray
import torch

from sequoia_ray.draft import DraftTree
from sequoia_ray.sampling import SparseDist
from sequoia_ray.tree.plan import TreePlan


@ray.remote(num_cpus=0)
class _Draft:
    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree

    @ray.method(num_returns=2)
    def grow(self, request_id: str, plan: TreePlan, commits=()):
        return True, self.tree


@ray.remote(num_cpus=0)
class _Target:
    def verify(self, request_id: str, plan: TreePlan, tree: DraftTree):
        return [0], [int(tree.tokens[0])]


def probe_tree(plan: TreePlan, *, sampled: bool, support: int = 64) -> DraftTree:
    """A tree of ``plan``'s size as the draft sends it (D over ``support`` tokens at every inner node)."""
    dists = {node: SparseDist(torch.arange(support), torch.full((support,), 1 / support))
             for node, kids in enumerate(plan.children) if kids} if sampled else {}
    return DraftTree(torch.zeros(plan.n, dtype=torch.long), dists)


def measure_calls(plan: TreePlan, *, sampled: bool = False, repeats: int = 30) -> tuple[float, float]:
    """Median seconds of the calls of (a root-only step, a step with ``plan``'s tree), alternating."""
    draft, target = _Draft.remote(probe_tree(plan, sampled=sampled)), _Target.remote()
    root = DraftTree(torch.zeros(1, dtype=torch.long), {})
    root_plan = TreePlan((-1,))

    def alone() -> None:
        ray.get(target.verify.remote("probe", root_plan, root))

    def tree() -> None:
        ok, ref = draft.grow.remote("probe", plan, [])
        ray.get(ok)
        ray.get(target.verify.remote("probe", plan, ref))

    try:
        for f in (alone, tree):  # the actors start, and the first calls pay for it
            f()
        samples = {f: [] for f in (alone, tree)}
        for _ in range(repeats):
            for f, seen in samples.items():
                start = time.perf_counter()
                f()
                seen.append(time.perf_counter() - start)
        return statistics.median(samples[alone]), statistics.median(samples[tree])
    finally:
        for actor in (draft, target):
            ray.kill(actor)
