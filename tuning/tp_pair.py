"""The draft in-process and a tensor-parallel target as rank actors: what a TP profiling trial uses in
place of ``LocalPair`` (the same ``decoder`` / ``encode`` / ``time_target`` surface)."""

from __future__ import annotations

from actors.adapters import RanksTarget
from actors.base import assigned_device
from actors.placement import ActorResources
from actors.spec import ModelActorSpec
from actors.target import TargetGroup
from sequoia_ray.config import ProfileJobConfig
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.local import encode
from sequoia_ray.models.loading import TINY_DRAFT, TINY_TARGET, load_model


class GroupPair:
    def __init__(self, cfg: ProfileJobConfig, *, backend: str, num_cpus: float, num_gpus: float,
                 threads: int | None = None) -> None:
        draft, target = (TINY_DRAFT, TINY_TARGET) if cfg.smoke_test else (cfg.draft, cfg.target)
        dtype = "float32" if cfg.smoke_test else cfg.dtype
        self.draft = load_model(draft, dtype=dtype, quantize=cfg.draft_quantize, progress=False,
                                device=assigned_device(cfg.device), linears=cfg.linears, layers=cfg.layers,
                                draft_vocab=cfg.draft_vocab)
        spec = ModelActorSpec(target, dtype=dtype, device=cfg.device, threads=threads or max(1, int(num_cpus)),
                              linears=cfg.linears, layers=cfg.layers)
        self.group = TargetGroup(spec, cfg.tp_size, backend, ActorResources(num_cpus, num_gpus),
                                 first_bundle=1)
        self.tokenizer = self.draft.tokenizer

    def encode(self, text: str, *, chat: bool) -> list[int]:
        return encode(self.tokenizer, text, chat=chat)

    def time_target(self, sizes, context: int, repeats: int) -> dict[int, float]:
        return self.group.time_target(sizes, context, repeats)

    def decoder(self, plan, *, speculate: bool = True) -> SpeculativeDecoder:
        meta = self.group.meta
        return SpeculativeDecoder(RanksTarget(self.group.ranks), DraftWorker(self.draft.model) if speculate else None,
                                  plan, tokenizer=self.tokenizer, eos_ids=tuple(meta["eos_ids"]),
                                  max_context=meta["max_context"])

    def close(self) -> None:
        self.group.kill()
