"""How many torch threads a model actor's forward gets: all of them, or half while the other actor computes.

Only where tree requests pipeline (``ModelActorSpec.pipelines``: ``batch_wait_trees: false``, or one request per
forward). In lockstep (the default) every step drafts all tree requests, then verifies them all, so the two
actors never compute at once (the load traces' ``both`` is 0) and every forward runs on all the threads: with a
share there, a request that had just finished counted as "on the other actor", and at 8 clients through Serve
on the 2-core Xeon (session 41) a draft forward of 7 requests took 1.3x one of 8 and the target's verify beside
a newcomer's first step 1.2-1.7x a verify of 8 trees.

The draft and the target actors share the machine's cores, each running ``threads`` torch threads, and with
every torch call on one thread per process (``sequoia_ray.compute_thread``) libgomp's threads spin between
parallel regions. That is what a forward wants while it is alone, and ruinous while the other actor computes
too: two spinning teams of 2 threads on 2 cores. Tree requests do overlap — they pipeline, one group drafting
while the other verifies — and measured on a 2-core EPYC through Serve (session 14, trees one request per
forward, 2 clients): 5.3 tok/s with spinning teams, 16.4 with ``OMP_WAIT_POLICY=PASSIVE``; a shorter spin
(``GOMP_SPINCOUNT=3000``) gave 13.6 at 2 clients and cost 1 client its spin (12.4 against 13.3). A wait
policy is fixed when the process starts; a thread count is not. So a forward gets half the threads when a
tree request it does not carry was seen in the last ``window_s`` (that request is most likely on the other
actor now), and all of them otherwise: one client's trees, the target alone at any batch, tree requests in
lockstep. A request seen stepping the target alone is forgotten at once: when the service switches from trees
to the target alone (``live_cost``), its forwards get all the threads from the switch, not a second later. So
is a request that finished (``forget``), when its ``finish`` arrives.
"""

from __future__ import annotations

import time


class ThreadShare:
    """Per batch: the thread count to run it with (``threads`` or half of it)."""

    def __init__(self, threads: int, window_s: float = 1.0, clock=time.monotonic) -> None:
        self.threads, self.window_s, self.clock = threads, window_s, clock
        self.seen: dict[str, float] = {}  # tree request id -> when it was last in a batch here

    def threads_for(self, tree_requests: set[str], alone_requests: set[str] = frozenset()) -> int:
        """``tree_requests``: the batch's requests that step a tree (all of them for the draft);
        ``alone_requests``: those that step the target alone (a root-only verify): not elsewhere any more."""
        now = self.clock()
        for rid in tree_requests:
            self.seen[rid] = now
        self.seen = {rid: t for rid, t in self.seen.items() if now - t <= self.window_s and rid not in alone_requests}
        elsewhere = set(self.seen) - tree_requests
        return max(1, self.threads // 2) if elsewhere else self.threads

    def forget(self, request_id: str) -> None:
        """``request_id`` finished (or was freed): it is not elsewhere any more."""
        self.seen.pop(request_id, None)
