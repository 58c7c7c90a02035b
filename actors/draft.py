"""The draft model on its own actor: grows a request's token tree and returns it as host tensors."""

from __future__ import annotations

import logging

import ray

from actors.base import ModelActor, assigned_device, model_meta
from actors.spec import ModelActorSpec
from actors.thread_share import ThreadShare

logger = logging.getLogger(__name__)


class DraftActor(ModelActor):
    """Holds the draft model and per-request draft state (a Ray actor; plain Python in tests)."""

    def __init__(self, spec: ModelActorSpec) -> None:
        from sequoia_ray.draft import DraftWorker
        from sequoia_ray.models.loading import load_model

        device = assigned_device(spec.device)
        super().__init__(spec, device, fatal_errors=False)
        loaded = self.compute.run(load_model, spec.source, dtype=spec.dtype, quantize=spec.quantize, progress=False,
                                  device=device, linears=spec.linears, layers=spec.layers,
                                  draft_vocab=spec.draft_vocab)
        self.worker = self.compute.run(DraftWorker, loaded.model, layout=spec.batch_layout,
                                       prefill_chunk=spec.prefill_chunk, prefix_cache=spec.prefix_cache())
        self.meta = model_meta(loaded, device)
        self.share = ThreadShare(spec.threads) if spec.pipelines else None  # lockstep: never beside the target
        self._start_batcher(self._run_batch, self._run, waits=False)  # in lockstep the target waits, this gathers

    def call(self, method: str, request_id: str, *args):
        """One request's call; a ``grow`` joins the next draft forward with every other waiting ``grow``."""
        return self.batcher.call(method, request_id, *args)

    def _run(self, method: str, request_id: str, *args, stale=None):
        if method == "start" and self.reaper.finished_before(request_id):
            # its caller timed out on this start and abandoned the request (``ActorDraft.abandon``), and the
            # finish ran first: started now, the request would be held until the reaper frees it
            logger.info("start of request %s after its finish: not started", request_id)
            return None
        return super()._run(method, request_id, *args, stale=stale)

    @ray.method(num_returns=2)
    def grow(self, request_id: str, plan, commits=(), rule=None):
        """``(True, tree)`` as two objects: the caller waits on the small first one and hands the second, by
        reference, to the target, so the tree goes from this actor to the target without a stop at the caller."""
        return True, self.batcher.call("grow", request_id, plan, commits, rule)
