"""An in-process draft/target pair: load both models, check they share a vocabulary, build decoders."""

from __future__ import annotations

from dataclasses import dataclass

from sequoia_ray.config import DEFAULT_DRAFT_VOCAB
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models.loading import (DEFAULT_DRAFT, DEFAULT_TARGET, LoadedModel, check_load_options, check_source,
                                        load_model)
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import TreePlan


@dataclass
class LocalPair:
    target: LoadedModel
    draft: LoadedModel | None

    @classmethod
    def load(cls, target: str = DEFAULT_TARGET, draft: str | None = DEFAULT_DRAFT, *, dtype: str = "float32",
             draft_quantize: str | None = None, progress: bool = True, device: str = "auto",
             linears: str = "auto", layers: str = "auto",
             draft_vocab: int | None = DEFAULT_DRAFT_VOCAB) -> LocalPair:
        """Both models on ``device`` (``auto | cpu | cuda``, see ``sequoia_ray.devices``); ``linears``: see
        ``sequoia_ray.models.packed_linear``; ``layers``: see ``sequoia_ray.models.traced_layers``;
        ``draft_vocab``: see ``sequoia_ray.models.draft_vocab`` (None: the draft's full head). An int8 draft
        runs on the CPU only, so ``auto`` with one is the CPU for both (the CPU comparisons of benchmarks/ on a
        machine that also has a GPU); an explicit ``cuda`` with one stays an error."""
        if draft_quantize == "int8" and device == "auto":
            device = "cpu"
        if draft:  # the draft's options checked before the target loads (minutes, for a real one), not after
            check_load_options(dtype=dtype, quantize=draft_quantize, device=device, linears=linears, layers=layers,
                               draft_vocab=draft_vocab)
            check_source(draft)
        t = load_model(target, dtype=dtype, progress=progress, device=device, linears=linears, layers=layers)
        d = load_model(draft, dtype=dtype, quantize=draft_quantize, progress=progress, device=device,
                       linears=linears, layers=layers, draft_vocab=draft_vocab) if draft else None
        if d is not None:
            check_same_vocab(t, d)
        return cls(t, d)

    @classmethod
    def tiny(cls, device: str = "auto") -> LocalPair:
        """A tiny random pair (the draft is the target's first layers) with a character tokenizer: smoke tests."""
        from sequoia_ray.devices import resolve_device
        from sequoia_ray.models.loading import eos_ids
        from sequoia_ray.models.tiny import char_tokenizer, layered_pair

        where = resolve_device(device)
        target, draft = (m.to(where) for m in layered_pair())
        tok = char_tokenizer()
        loaded = [LoadedModel(m, tok, eos_ids(tok, m.generation_config), name, m.config.max_position_embeddings)
                  for m, name in ((target, "tiny-target"), (draft, "tiny-draft"))]
        return cls(*loaded)

    def decoder(self, plan: TreePlan, *, speculate: bool = True, policy=None, dynamic=None) -> SpeculativeDecoder:
        """``policy``: a per-request ``StepPolicy`` factory (e.g. ``RequestTrees.policy``); ``dynamic``: each
        step's dynamic-tree rule (e.g. ``DynamicRules.for_planned``); see the engine."""
        draft = DraftWorker(self.draft.model) if speculate and self.draft is not None else None
        return SpeculativeDecoder(TargetWorker(self.target.model), draft, plan, tokenizer=self.target.tokenizer,
                                  eos_ids=self.target.eos_ids, max_context=self.target.max_context, policy=policy,
                                  dynamic=dynamic,
                                  vocab_size=self.target.model.get_input_embeddings().num_embeddings)

    def encode(self, prompt: str | list[dict], *, chat: bool) -> list[int]:
        return encode(self.target.tokenizer, prompt, chat=chat)

    def time_target(self, sizes, context: int, repeats: int) -> dict[int, float]:
        from sequoia_ray.hardware import time_forward

        return time_forward(self.target.model, sizes, context=context, repeats=repeats)


def encode(tokenizer, prompt: str | list[dict], *, chat: bool) -> list[int]:
    """Token ids of a prompt (the one place prompts are encoded: the command line, profiling, the ingress).
    ``chat``: through the tokenizer's chat template, ``prompt`` being one user turn's text or a list of
    ``{"role", "content"}`` messages; else plain text."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tokenizer(prompt)["input_ids"]


def check_same_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    why = pair_refusal(target.model.config.vocab_size, draft.model.config.vocab_size,
                       target.tokenizer.get_vocab() == draft.tokenizer.get_vocab())
    if why:
        raise ValueError(f"draft {draft.name!r} cannot speculate for target {target.name!r}: {why}")


def pair_refusal(target_rows: int | None, draft_rows: int | None, same_tokenizer: bool | None) -> str | None:
    """Why a draft cannot speculate for a target, or None (a value None: not known, not refused). The tokenizers
    must be one and the embedding tables of one size, even when a table is only padded past the tokenizer for the
    hardware (Qwen2.5 0.5B has 151,936 rows, 7B 152,064): once a node's draft distribution is exhausted, the
    draft draws its children uniformly over its own ids, and the verifier prices them uniform over the target's
    (``sampling.node_steps``), which is exact only when the two id ranges are the same."""
    if same_tokenizer is False:
        return "the draft's tokenizer is not the target's: speculative decoding needs a same-tokenizer pair"
    if None not in (target_rows, draft_rows) and draft_rows != target_rows:
        return (f"the draft's vocabulary has {draft_rows} ids, the target's {target_rows}: speculative decoding "
                "needs a draft with the target's vocabulary (its uniform fallback must cover the verifier's ids)")
    return None
