"""PrefixCache: prompt prefixes prefilled once per worker; later requests start past them, with the same tokens."""

from __future__ import annotations

import pytest
import torch

from deployments.config import ServeConfig
from actors.spec import ModelActorSpec
from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models.kv_store import KVStore
from sequoia_ray.prefix_cache import PrefixCache
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import k_ary
from tests.tiny import agreeing_pair

SYSTEM = [(i * 7) % 90 + 3 for i in range(40)]  # a shared preamble, 5 blocks of 8


def _store(tokens: int, layers: int = 2) -> KVStore:
    """A store whose slot i holds the value i in every element (so a block's slots are recognisable)."""
    store = KVStore(layers)
    slots = torch.arange(tokens, dtype=torch.float32).view(1, 1, 1, tokens, 1).expand(layers, 1, 2, tokens, 4)
    store.append(slots.clone(), -slots.clone())
    return store


def test_blocks_are_found_after_exactly_their_prefix():
    cache = PrefixCache(block=4, max_tokens=64)
    prompt = list(range(100, 113))  # 13 tokens: 3 whole blocks (the 4th would hold none but the last token)
    cache.insert(prompt, _store(13))
    assert cache.tokens == 12
    chain = cache.lookup(prompt + [7, 8])
    assert len(chain) == 3 and float(chain[2].keys[0, 0, 0, 0, 0]) == 8.0  # the third block: slots 8..11
    assert float(chain[2].values[0, 0, 0, 3, 0]) == -11.0
    assert len(cache.lookup(prompt[:12])) == 2  # never the block of the last token: it is forwarded
    assert len(cache.lookup([999] + prompt[1:])) == 0  # another first token: nothing matches after it
    assert len(cache.lookup(prompt[:4] + [999] * 9)) == 1  # the same first block only
    assert cache.reused == 4 * (3 + 2 + 0 + 1)


def test_the_least_recently_used_blocks_go_first_a_prefix_from_its_end():
    cache = PrefixCache(block=4, max_tokens=16)
    a, b = list(range(0, 13)), list(range(50, 63))
    cache.insert(a, _store(13))  # 3 blocks
    cache.insert(b, _store(13))  # 3 more: 6 > 4 blocks, a's last blocks go first
    assert cache.tokens == 16
    assert len(cache.lookup(b)) == 3 and len(cache.lookup(a)) == 1  # a keeps its first block


def test_sizes_are_checked():
    with pytest.raises(ValueError, match="block 0"):
        PrefixCache(block=0)
    with pytest.raises(ValueError, match="holds no block"):
        PrefixCache(block=16, max_tokens=8)
    with pytest.raises(ValueError, match="prefix_cache_tokens 8 holds no block"):
        ServeConfig(prefix_cache_tokens=8, prefix_block=16)
    with pytest.raises(ValueError, match="prefix_cache_tokens -1"):
        ModelActorSpec("tiny-target", prefix_cache_tokens=-1)
    assert ServeConfig(prefix_cache_tokens=0).actor_spec("target").prefix_cache() is None
    made = ServeConfig(prefix_cache_tokens=64, prefix_block=8).actor_spec("draft").prefix_cache()
    assert (made.block, made.max_tokens) == (8, 64)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_requests_sharing_a_preamble_skip_its_prefill_and_keep_their_tokens(temperature):
    """fp32 tiny pair: requests that begin with the same 40 tokens prefill them once on each worker (the
    target forwards 1 prompt token, not 41, from the second on); every request's tokens equal those without a
    prefix cache (greedy: the target alone's; sampled: the same seed's)."""
    target, draft = agreeing_pair()
    params = SamplingParams(max_tokens=16, seed=3, temperature=temperature, ignore_eos=True)
    tw = TargetWorker(target, prefix_cache=PrefixCache(8, 256))
    dw = DraftWorker(draft, prefix_cache=PrefixCache(8, 256))
    cached = SpeculativeDecoder(tw, dw, k_ary(2, 3))
    plain = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), k_ary(2, 3))
    for r in range(3):
        prompt = SYSTEM + [r + 3, 5]
        before = tw.prefilled
        out = cached.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        assert tw.prefilled - before == (41 if r == 0 else 1)
    assert tw.prefix_cache.reused == dw.prefix_cache.reused == 2 * 40


def test_only_slots_every_layer_holds_are_cached():
    """A store whose layers differ in length (a forward that failed after its first layers appended) has slots
    the others never wrote: only the shortest layer's length is cached."""
    store = _store(13)
    store.lengths = [13, 5]  # layer 1 stopped at 5
    cache = PrefixCache(block=4, max_tokens=64)
    cache.insert(list(range(100, 113)), store)
    assert cache.tokens == 4  # one whole block of the 5 slots both layers hold (was 12: 3 blocks)


@pytest.mark.parametrize("layout, error", [("padded", RuntimeError), ("ragged", RuntimeError),
                                           ("padded", KeyboardInterrupt)])
def test_a_draft_forward_that_fails_midway_leaves_no_half_written_slots_to_cache(layout, error, monkeypatch):
    """A grow that failed in its first layer's MLP (an out-of-memory), after that layer's attention appended its
    K/V, left the other layers short: the engine then
    finished the request, and the prefix cache kept slots the failed layers never wrote (uninitialised memory)
    for every later request with that preamble: 34 of 40 nodes of the next same-prompt tree differed."""
    from sequoia_ray.models.kv_store import store_of

    _, draft = agreeing_pair(0.3)
    prompt, params, tree = SYSTEM[:33], SamplingParams(max_tokens=10, temperature=0), k_ary(3, 3)
    worker = DraftWorker(draft, layout=layout, prefix_cache=PrefixCache(8, 256))
    worker.start("a", prompt, params, 0)
    layers = draft.model.layers
    assert len(layers) >= 2

    def out_of_memory(*args, **kwargs):
        raise error("out of memory in layer 0's MLP")

    monkeypatch.setattr(layers[0].mlp, "forward", out_of_memory)
    with pytest.raises(error, match="out of memory"):
        worker.grow("a", tree)
    lengths = store_of(worker.requests["a"].session.cache).lengths
    assert len(set(lengths)) <= 1, lengths  # every layer back where it was
    monkeypatch.undo()
    worker.finish("a")
    worker.start("b", prompt, params, 0)
    fresh = DraftWorker(draft, layout=layout)
    fresh.start("c", prompt, params, 0)
    assert worker.grow("b", tree).tokens.tolist() == fresh.grow("c", tree).tokens.tolist()
