"""Walk a verified tree from the root: keep the longest accepted path plus one residual/bonus token.

Devices: the target's logits stay on its device, and the walk never syncs the host once per node. Greedy:
one argmax over all n rows on the device, one transfer of the ``[n]`` ids, then the walk in Python (on a
CPU target, where there is no sync to save, only the visited rows). Sampled
(T > 0): the ``[n, V]`` logits come to the host in ONE transfer and the walk runs there — temperature, top-p,
the per-node acceptance tests and the residual/bonus draws — with the request's *host* generator (the
target worker creates it on the CPU). So the draws do not depend on the target's device: same seed, same
tokens on a CPU or a GPU target (given the same logits), and at batch 1 exactly the draws of a host walk.
Cost of that choice: the transfer is n x V float32 (n = 64, V = 152k: 39 MB, a few ms over PCIe). Moving less
would mean drawing the residual/bonus candidates on the device before the walk — a different random stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftTree
from sequoia_ray.sampling import sample, target_probs, verify_node
from sequoia_ray.tree.plan import TreePlan


@dataclass(frozen=True)
class Verdict:
    path: list[int]  # node ids from the root (0) to the deepest accepted node
    tokens: list[int]  # the accepted draft tokens then one residual or bonus token: len(path) tokens
    # (children, accepted rank) per visited inner node, root first: rank is 1-based in draw order, 0 = every
    # child rejected; the last visited node is absent when it is a leaf (it gives no observation). What live
    # acceptance estimation learns from, for whatever tree was verified.
    ranks: tuple[tuple[int, int], ...] = ()
    # Prompt tokens the target forwarded for other requests since this request's last verdict (in its forward
    # or one its call queued behind; 0 when none): a prefill chunk costs several decode forwards, so such a
    # step's time says little about its own tree (``live_cost`` does not measure it).
    prefill_beside: int = field(default=0, compare=False)  # not the verdict itself: batched == alone
    nodes: int = field(default=0, compare=False)  # the verified tree's nodes, root included (0: not told)
    # per token (when the request asks, ``SamplingParams.logprobs``): its log-probability under the target and the
    # likeliest ids with theirs (``token_logprobs``); not compared: floats of a batched forward may differ in ulps
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] = field(default=(), compare=False)


def verify_tree(
    plan: TreePlan,
    draft: DraftTree,  # host tensors
    logits: torch.Tensor | list[int],  # [n, V] target logits at every tree node, on the target's device; or,
    # greedy, each node's argmax already read (``batch_inputs``)
    params: SamplingParams,
    generator: torch.Generator,  # a host generator (the walk runs on the host)
) -> Verdict:
    tree_tokens = draft.tokens.tolist()
    if params.greedy:
        best = logits.__getitem__ if isinstance(logits, list) else _argmax_per_node(logits)
        return _walk(plan, tree_tokens, lambda node, kids: _greedy_step(best(node), kids))
    host = logits.cpu().float()  # [n, V]: the one transfer of a sampled walk (in the model's dtype: half the bytes)
    return _walk(plan, tree_tokens,
                 lambda node, kids: _sampled_step(host[node], draft, node, kids, params, generator))


def token_logprobs(logits: torch.Tensor, verdict: Verdict, top: int
                   ) -> tuple[tuple[float, tuple[tuple[int, float], ...]], ...]:
    """Each of the verdict's tokens with its log-probability under the target's raw logits where it was drawn (an
    accepted child: at its parent's row; the residual or bonus token: at the last accepted node's) and the ``top``
    likeliest ids with theirs. ``logits``: ``[n, V]``, the request's tree rows, on the target's device (one read of
    ``[len(path), 1 + 2 top]`` numbers)."""
    rows = logits[verdict.path].float().log_softmax(-1)  # [k, V], k = len(path) = len(tokens)
    chosen = rows.gather(1, torch.tensor(verdict.tokens, device=rows.device)[:, None])  # [k, 1]
    values, ids = rows.topk(top, dim=-1) if top else (rows[:, :0], rows[:, :0].long())  # [k, top]
    host = torch.cat([chosen, values, ids.float()], dim=1).cpu()  # ids < 2**24: exact in float32
    return tuple((row[0], tuple(zip(map(int, row[1 + top:]), row[1 : 1 + top]))) for row in host.tolist())


def batch_inputs(logits: torch.Tensor, sizes: list[int], greedy: list[bool], gather: bool | None = None
                 ) -> list[torch.Tensor | list[int]]:
    """Each request's ``verify_tree`` input from a batch's ``[sum n, V]`` logits (request i: ``sizes[i]`` rows).
    On an accelerator (``gather``; default: not on the CPU) with at most two host reads for the whole batch, not
    one per request: one argmax over every row and one transfer of the ``[sum n]`` ids for the greedy requests;
    one transfer of the sampled requests' rows. On the CPU (nothing to sync) each request's rows as they are (a
    greedy walk reads only the rows it visits). ``gather`` lets a CPU test run the accelerator's path."""
    parts = list(logits.split(sizes))
    if gather is None:
        gather = logits.device.type != "cpu"
    if not gather:
        return parts
    if any(greedy):
        ids = logits.argmax(dim=-1).tolist()  # [sum n]: the greedy walks' one read
        for i, (start, size) in enumerate(zip(accumulate(sizes, initial=0), sizes)):
            if greedy[i]:
                parts[i] = ids[start : start + size]
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        host = torch.cat([parts[i] for i in sampled]).cpu().float()  # the sampled walks' one read (then fp32: exact)
        for i, rows in zip(sampled, host.split([sizes[i] for i in sampled])):
            parts[i] = rows
    return parts


def _argmax_per_node(logits: torch.Tensor):  # [n, V] -> (node -> argmax of its row)
    """On an accelerator all n rows at once, one transfer of the [n] ids (a read per node would sync per
    node); on the CPU only the rows the walk visits (nothing to sync, and n rows of a large vocabulary cost).
    On the CPU ``max(0).indices``, the same index as ``argmax`` (the first maximal value, ties and NaN alike):
    over a row of 151,936 float32 logits it takes 0.08 ms where ``argmax`` takes 0.23 (2-core Xeon, session 40),
    and a batch of 8 requests' walks reads ~24 rows a step."""
    if logits.device.type == "cpu":
        return lambda node: int(logits[node].max(0).indices)
    return logits.argmax(dim=-1).tolist().__getitem__


def _walk(plan: TreePlan, tree_tokens: list[int], step) -> Verdict:
    """From the root, ``step(node, child_tokens) -> (chosen child index | None, token)`` until it stops."""
    node, path, out, ranks = 0, [0], [], []
    while True:
        kids = plan.children[node]
        child_tokens = [tree_tokens[c] for c in kids]
        chosen, token = step(node, child_tokens)
        if kids:
            ranks.append((len(kids), 0 if chosen is None else chosen + 1))
        if chosen is None:
            out.append(token)
            return Verdict(path, out, tuple(ranks), nodes=plan.n)
        node = kids[chosen]
        path.append(node)
        out.append(child_tokens[chosen])


def _greedy_step(best: int, children: list[int]) -> tuple[int | None, int]:
    return (children.index(best) if best in children else None), best


def _sampled_step(logits, draft: DraftTree, node: int, children: list[int], params, generator):
    p = target_probs(logits, params.temperature, params.top_p)
    if not children:
        return None, sample(p, generator)  # bonus token at an accepted leaf
    d = draft.dists[node].dense(p.shape[-1], p.dtype)
    verdict = verify_node(p, d, children, generator)
    return verdict.accepted, verdict.token
