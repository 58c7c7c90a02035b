"""The draft's LM head on part of the vocabulary: the idea of FR-Spec (Zhao et al., 2025, frequency-ranked
speculative sampling), with the tokenizer's own order as the frequency ranking.

A draft level is memory-bound (it reads every weight once per forward) and a small draft with a large vocabulary
spends much of it in the head: the Qwen2.5 0.5B draft's 151,936 x 896 head is 28% of its weights, int8 5.5 ms of
a ~19 ms level on the 2-core EPYC. ``restrict_head`` replaces the head by one over the ``size`` lowest ids plus
every special and added token (end of sequence, chat markers, which BPE tokenizers number last), giving -inf
logits to the rest. Byte-pair vocabularies number their tokens in merge order, most frequent pairs first: on
local text outside the benchmarks (Python's standard library, the system's licence texts) ids below 65,536 are
98.3% of the code tokens and 98.5% of the prose tokens (below 32,768: 94.7% and 95.2%).

Lossless whatever the subset: the target verifies every tree. Greedy, it accepts its own argmax wherever it is
in the tree; sampled, the draft's D is the distribution its tokens are drawn from — zero outside the subset,
which the verifier's residual covers. The subset only costs acceptance when the target's next token lies
outside it (the draft could not have proposed it). Never for a target: its head is the distribution served.

The draft worker itself never scatters: it draws on the kept logits ([K], ``kept_logits``) and maps positions to
ids, the same trees and the same D as on [V] logits with -inf elsewhere, with every top-k, softmax and nucleus
over 65,536 ids instead of 151,936 (a grow 0.94x the time at 8 requests, 0.96-0.985x at 1 on the 2-core Xeon:
``benchmarks/draft_draws.py``). ``SubsetHead.forward`` keeps the whole vocabulary for every other caller.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class SubsetHead(torch.nn.Module):
    """An LM head over ``ids`` (a Linear whose row i is the full head's row ``ids[i]``), scattered back to
    ``vocab`` logits: the others are -inf, so softmax gives them exactly 0 and top-k never picks them. (A model
    whose own forward soft-caps its logits, Gemma 2's, turns -inf into -cap there; the engine's ``KVSession.head``
    keeps -inf. Transformers' assisted generation on such a draft may propose a left-out id: still lossless.)"""

    def __init__(self, linear: torch.nn.Module, ids: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.linear = linear  # an nn.Linear; quantising or packing the model replaces it like any other
        self.register_buffer("ids", ids, persistent=False)  # [K] int64, increasing
        self.vocab = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., vocab]
        kept = self.linear(hidden)  # [..., K]
        out = kept.new_full((*kept.shape[:-1], self.vocab), float("-inf"))
        return out.index_copy_(-1, self.ids, kept)

    def extra_repr(self) -> str:
        return f"kept={self.ids.numel()}, vocab={self.vocab}"


def kept_logits(model: torch.nn.Module, hidden: torch.Tensor, head) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``hidden`` [k, H] -> (float32 logits [k, K], the ids [K] they stand for): a ``SubsetHead``'s own product,
    without scattering it into the whole vocabulary (a draft's top-k, softmax and nucleus over 65,536 ids
    rather than 151,936); else ``head(hidden)`` (every id, ids None). Soft-capped logits take the whole head."""
    subset = model.get_output_embeddings()
    if isinstance(subset, SubsetHead) and not getattr(model.config, "final_logit_softcapping", None):
        with torch.inference_mode():
            return subset.linear(hidden).float(), subset.ids
    return head(hidden), None


def check_size(size: int | None) -> None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"draft vocabulary size {size!r} must be an integer >= 1 (the lowest ids kept in the "
                         "draft's LM head), or None for the full head")


def kept_ids(tokenizer, size: int, vocab: int, keep=()) -> list[int]:
    """The ids below ``size``, every special and added token of ``tokenizer`` and the ids ``keep`` (the model's
    end-of-sequence ids, which a generation config may name beyond the tokenizer's), within ``vocab``, sorted."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ()) | set(keep)
    special |= set(getattr(tokenizer, "added_tokens_decoder", None) or ())
    special |= {i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None}
    return sorted(set(range(min(size, vocab))) | {i for i in special if 0 <= i < vocab})


def restrict_head(model: torch.nn.Module, tokenizer, size: int | None, keep=()) -> bool:
    """Give ``model`` (a draft, before quantising or packing) a ``SubsetHead`` over ``kept_ids`` (``keep``: ids
    kept whatever ``size``, e.g. every end-of-sequence id); False when ``size`` is None, keeps every id anyway, or
    the head is not a plain ``nn.Linear`` (a warning: the full head stays)."""
    check_size(size)
    if size is None:
        return False
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        logger.warning("draft_vocab %d not applied: the draft's LM head is a %s, not a Linear; the full head stays",
                       size, type(head).__name__)
        return False
    vocab = head.out_features
    ids = kept_ids(tokenizer, size, vocab, keep)
    if len(ids) >= vocab:
        return False
    index = torch.tensor(ids, dtype=torch.long, device=head.weight.device)
    linear = torch.nn.Linear(head.in_features, len(ids), bias=head.bias is not None,
                             device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(head.weight[index])  # a copy: a tied head's embedding stays whole
        if head.bias is not None:
            linear.bias.copy_(head.bias[index])
    model.set_output_embeddings(SubsetHead(linear, index, vocab))
    logger.info("draft vocabulary: the LM head keeps %d of %d ids", len(ids), vocab)
    return True
