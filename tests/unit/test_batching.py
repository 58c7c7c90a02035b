"""The batched path: continuous batching of the draft's and the target's calls, exact against each request
alone (greedy = the target alone; a sampled seed gives the same tokens at batch 1 and in a batch), a failing
request dropped from its batch without touching the others, long prompts prefilled in chunks."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from sequoia_ray.batching import (GATHER_S, LOCKSTEP_LOOKBACK, NOT_YET, BatchedWorker, Batcher, BatchLimits, comes_back_after_any_step,
                                  comes_straight_back)
from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.engine import SpeculativeDecoder
from sequoia_ray.models.batch_forward import LAYOUTS
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import chain, from_nested, k_ary
from tests.tiny import agreeing_pair, ragged_prompts

PLAN = from_nested([[[[]], []], [[]], []])  # 7 nodes, 4 levels, ragged


@pytest.fixture(scope="module")
def models():
    return agreeing_pair()




def _alone(target, draft, plan, prompt, params):
    spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft) if draft else None, plan)
    return spec.generate(prompt, params).token_ids


class _Pair:
    """Target and draft workers behind batchers, as the actors run them."""

    with_steps = False

    def __init__(self, target, draft, limits=BatchLimits(), layout="padded", prefill_chunk=None):
        self.target_worker = TargetWorker(target, layout=layout, prefill_chunk=prefill_chunk)
        self.draft_worker = DraftWorker(draft, layout=layout, prefill_chunk=prefill_chunk)
        self.target_batcher = Batcher.over(self.target_worker, limits, name="target")
        self.draft_batcher = Batcher.over(self.draft_worker, limits, name="draft")

    def decoder(self, plan):
        return SpeculativeDecoder(BatchedWorker(self.target_batcher), BatchedWorker(self.draft_batcher), plan)

    def run(self, plan, jobs):
        """``jobs`` = [(prompt, params)], all at once from one thread each; their token ids."""
        start = threading.Barrier(len(jobs))

        def one(job):
            start.wait()
            out = self.decoder(plan).generate(*job)
            return (out.token_ids, out.stats.steps) if self.with_steps else out.token_ids

        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(one, jobs))

    def close(self):
        self.target_batcher.close()
        self.draft_batcher.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_in_a_batch_of_8_is_the_target_alone(models, layout):
    target, draft = models
    pair = _Pair(target, draft, layout=layout)
    pair.with_steps = True
    prompts = ragged_prompts(8)
    params = [SamplingParams(max_tokens=12 + 3 * r, seed=r) for r in range(8)]  # ragged lengths: some finish first
    try:
        got = pair.run(PLAN, list(zip(prompts, params)))
    finally:
        pair.close()
    for prompt, p, (ids, steps) in zip(prompts, params, got):
        assert ids == _alone(target, None, chain(0), prompt, p)
        # the draft's batched trees are its trees alone: the same number of steps as speculating alone
        spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), PLAN)
        assert steps == spec.generate(prompt, p).stats.steps
    assert max(pair.target_batcher.batch_sizes) > 1 and max(pair.draft_batcher.batch_sizes) > 1, "never batched"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_sampled_seed_gives_the_same_tokens_at_batch_1_and_in_a_batch_of_8(models, layout):
    target, draft = models
    prompts = ragged_prompts(8)
    params = [SamplingParams(max_tokens=16, temperature=t, top_p=tp, seed=100 + r)
              for r, (t, tp) in enumerate([(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.5, 0.8)] * 2)]
    pair = _Pair(target, draft, layout=layout)
    try:
        got = pair.run(k_ary(3, 2), list(zip(prompts, params)))
    finally:
        pair.close()
    for prompt, p, ids in zip(prompts, params, got):
        assert ids == _alone(target, draft, k_ary(3, 2), prompt, p)
    assert max(pair.target_batcher.batch_sizes) > 1


def test_one_request_per_forward_when_max_batch_requests_is_1(models):
    target, draft = models
    pair = _Pair(target, draft, BatchLimits(max_batch_requests=1))
    try:
        pair.run(PLAN, [(p, SamplingParams(max_tokens=6)) for p in ragged_prompts(4)])
    finally:
        pair.close()
    assert set(pair.target_batcher.batch_sizes) == {1} and set(pair.draft_batcher.batch_sizes) == {1}


def _started(target, draft, n, params=SamplingParams(max_tokens=50)):
    tw, dw = TargetWorker(target), DraftWorker(draft)
    for r, prompt in enumerate(ragged_prompts(n)):
        tw.start(str(r), prompt, params, seed=r)
        dw.start(str(r), prompt, params, seed=r)
    return tw, dw


def test_a_failing_request_is_dropped_from_its_batch_and_the_others_go_on(models, monkeypatch):
    target, draft = models
    tw, dw = _started(target, draft, 5)
    ref_t, ref_d = _started(target, draft, 5)
    trees = dw.grow_batch([(str(r), PLAN) for r in range(5)])
    bad_tree = trees[2]
    calls = [("0", PLAN, trees[0]), ("gone", PLAN, trees[1]),  # state missing
             ("1", PLAN, trees[1]), ("2", k_ary(2, 1), bad_tree),  # a tree that does not fit its plan
             ("3", PLAN, trees[3]), ("4", PLAN, trees[4])]
    import sequoia_ray.target as target_module

    real = target_module.verify_tree
    walks = iter(range(100))

    def walk_fails_once(plan, tree, logits, params, gen):  # the 3rd walk (request "3") raises
        if next(walks) == 2:
            raise RuntimeError("a walk failed")
        return real(plan, tree, logits, params, gen)

    monkeypatch.setattr(target_module, "verify_tree", walk_fails_once)
    out = tw.verify_batch(calls)
    monkeypatch.setattr(target_module, "verify_tree", real)
    assert "not active" in str(out[1]) and "draft tree has" in str(out[3]) and "a walk failed" in str(out[4])
    for slot, r in ((0, 0), (2, 1), (5, 4)):  # the others: the verdict each gets alone
        ref_tree = ref_d.grow(str(r), PLAN)
        assert out[slot] == ref_t.verify(str(r), PLAN, ref_tree)
    assert tw.requests["3"].session.length == len(tw.requests["3"].committed) - 1  # no tree K/V left behind
    # the failed request can go on: a fresh tree (regrown, nothing committed) gets its reference's verdict
    assert tw.verify("3", PLAN, dw.grow("3", PLAN)) == ref_t.verify("3", PLAN, ref_d.grow("3", PLAN))


def test_a_forward_that_fails_as_a_whole_is_retried_request_by_request(models, monkeypatch):
    target, draft = models
    tw, dw = _started(target, draft, 3)
    ref_t, ref_d = _started(target, draft, 3)
    trees = dw.grow_batch([(str(r), PLAN) for r in range(3)])
    import sequoia_ray.target as target_module

    real = target_module.hidden_many
    monkeypatch.setattr(target_module, "hidden_many",
                        lambda m, segs, layout: real(m, segs, layout) if len(segs) == 1 else 1 / 0)
    out = tw.verify_batch([(str(r), PLAN, trees[r]) for r in range(3)])
    assert out == [ref_t.verify(str(r), PLAN, ref_d.grow(str(r), PLAN)) for r in range(3)]


def test_a_batched_grow_that_fails_past_its_first_level_regrows_each_sampled_tree_as_alone(models, monkeypatch):
    """The batch's second draft forward fails after the first level's children were drawn: each request regrows
    alone from its generator as it was before the batch, so its tree is the one its seed gives alone."""
    import sequoia_ray.draft as draft_module

    target, draft = models
    params = SamplingParams(max_tokens=50, temperature=1.0)
    _, dw = _started(target, draft, 3, params)
    _, ref = _started(target, draft, 3, params)
    real, forwards = draft_module.hidden_many, []

    def failing(model, segments, layout):
        forwards.append(len(segments))
        return 1 / 0 if len(forwards) == 2 else real(model, segments, layout)

    monkeypatch.setattr(draft_module, "hidden_many", failing)
    trees = dw.grow_batch([(str(r), PLAN) for r in range(3)])
    assert forwards[:2] == [3, 3]  # the roots' forward, then the failed level
    for r, tree in enumerate(trees):
        alone = ref.grow(str(r), PLAN)
        assert torch.equal(tree.tokens, alone.tokens)
        assert all(torch.equal(tree.dists[k].tokens, alone.dists[k].tokens) for k in alone.dists)


def test_a_head_that_fails_on_the_batch_is_retried_request_by_request(models, monkeypatch):
    """The LM-head call on the batch's tree rows fails (e.g. out of memory on [sum n, V] logits): like a failed
    decoder forward, every session is rolled back and each request verified alone, with the same verdicts."""
    from sequoia_ray.models.tree_lm import KVSession

    target, draft = models
    tw, dw = _started(target, draft, 3)
    ref_t, ref_d = _started(target, draft, 3)
    trees = dw.grow_batch([(str(r), PLAN) for r in range(3)])
    want = [ref_t.verify(str(r), PLAN, ref_d.grow(str(r), PLAN)) for r in range(3)]
    real = KVSession.head
    monkeypatch.setattr(KVSession, "head", lambda self, rows: real(self, rows) if rows.shape[0] == PLAN.n else 1 / 0)
    assert tw.verify_batch([(str(r), PLAN, trees[r]) for r in range(3)]) == want


def test_walk_inputs_that_fail_on_the_batch_are_retried_request_by_request(models, monkeypatch):
    """The walks' inputs (on an accelerator the argmax and the sampled rows' copy, a second [sum n, V] buffer)
    failed outside the rollback: every request of the batch failed and kept its tree K/V, corrupting its next
    verify. Now as a failed head: rolled back, each verified alone, the same verdicts."""
    import sequoia_ray.target as target_module

    target, draft = models
    params = SamplingParams(max_tokens=50, temperature=0.8, seed=3)
    tw, dw = _started(target, draft, 3, params)
    ref_t, ref_d = _started(target, draft, 3, params)
    trees = dw.grow_batch([(str(r), PLAN) for r in range(3)])
    want = [ref_t.verify(str(r), PLAN, ref_d.grow(str(r), PLAN)) for r in range(3)]
    real = target_module.batch_inputs

    def failing(logits, sizes, greedy):
        if len(sizes) > 1:
            raise torch.OutOfMemoryError("out of memory copying the sampled rows")
        return real(logits, sizes, greedy)

    monkeypatch.setattr(target_module, "batch_inputs", failing)
    assert tw.verify_batch([(str(r), PLAN, trees[r]) for r in range(3)]) == want
    assert all(tw.requests[str(r)].session.length == len(tw.requests[str(r)].committed) - 1 for r in range(3))


@pytest.mark.parametrize("where", ["forward", "walk"])
def test_a_cuda_error_is_not_caught_per_request(models, monkeypatch, where):
    """A CUDA error leaves the device unusable: retrying the batch's requests one by one, or failing one request
    and going on, would fail every call after it. It leaves the batch (and ends the actor)."""
    import sequoia_ray.draft as draft_module
    import sequoia_ray.target as target_module

    target, draft = models
    tw, dw = _started(target, draft, 3)
    trees = dw.grow_batch([(str(r), PLAN) for r in range(3)])
    fault = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    def broken(*args, **kwargs):
        raise fault

    monkeypatch.setattr(target_module, "hidden_many" if where == "forward" else "verify_tree", broken)
    with pytest.raises(torch.AcceleratorError):
        tw.verify_batch([(str(r), PLAN, trees[r]) for r in range(3)])
    monkeypatch.setattr(draft_module, "hidden_many", broken)
    with pytest.raises(torch.AcceleratorError):
        dw.grow_batch([(str(r), PLAN) for r in range(3)])


@pytest.mark.parametrize("kind", [TargetWorker, DraftWorker])
def test_a_prefill_chunk_below_one_is_refused(models, kind):
    with pytest.raises(ValueError, match="prefill_chunk 0 must be >= 1"):  # it would forward empty chunks for ever
        kind(models[0], prefill_chunk=0)


@pytest.mark.parametrize("chunk", [1, 3, 4])
def test_a_long_prompt_prefilled_in_chunks_gives_the_same_tokens(models, chunk):
    target, draft = models
    prompt = ragged_prompts(4)[3]  # 11 tokens
    for params in (SamplingParams(max_tokens=10), SamplingParams(max_tokens=10, temperature=1.0, seed=3)):
        spec = SpeculativeDecoder(TargetWorker(target, prefill_chunk=chunk), DraftWorker(draft, prefill_chunk=chunk),
                                  PLAN)
        assert spec.generate(prompt, params).token_ids == _alone(target, draft, PLAN, prompt, params)


@pytest.mark.parametrize("chunk", [None, 64])
def test_the_drafts_token_count_is_what_its_next_grow_forwards(models, chunk):
    """The batcher's budget counts a grow's first forward (the tokens not yet cached) and the tree. The draft's
    count read the cache as the last commit left it, before the grow's own commits: after a whole prompt, every
    step counted the prompt again (308 tokens for a 2-token forward), a request then running alone; and with
    ``prefill_chunk`` every tree step counted as a chunk, so batches went over the budget."""
    import sequoia_ray.draft as draft_module

    target, draft = models
    plan = from_nested([[[[]], []], [[]], []])
    dw, tw = DraftWorker(draft, prefill_chunk=chunk), TargetWorker(target)
    first_forwards = []
    forward = draft_module.DraftWorker._forward

    def recorded(self, segments, *, last_only):
        if last_only:
            first_forwards.append(sum(s.q for s in segments.values()))
        return forward(self, segments, last_only=last_only)

    prompt = [(i * 7) % 97 for i in range(150)]
    params = SamplingParams(max_tokens=40, temperature=0)
    dw.start("r", prompt, params, 1)
    tw.start("r", prompt, params, 2)
    commits, counted, forwarded = [], [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_module.DraftWorker, "_forward", recorded)
        for _ in range(5):
            counted.append(dw.tokens_of("grow", "r", (plan, list(commits))))
            tree = dw.grow("r", plan, list(commits))
            forwarded.append(first_forwards[-1] + plan.n)  # the last forward of the grow's prefill, and the tree
            verdict = tw.verify("r", plan, tree)
            commits = [(verdict.path, verdict.tokens, len(tw.requests["r"].committed) - len(verdict.tokens))]
    assert counted[1:] == forwarded[1:] and max(counted[1:]) < 20, (counted, forwarded)


def test_a_chunked_prefill_takes_one_chunk_per_step_beside_the_others(models):
    target, draft = models
    tw = TargetWorker(target, prefill_chunk=4)
    params = SamplingParams(max_tokens=5)
    tw.start("long", list(range(1, 12)), params, seed=0)  # 10 tokens to prefill before the root
    tw.start("short", [5, 6], params, seed=1)
    root_only = torch.tensor([11])
    from sequoia_ray.draft import DraftTree

    assert tw.tokens_of("verify", "long", (chain(0),)) == 4
    out = tw.verify_batch([("long", chain(0), DraftTree(root_only, {})), ("short", chain(0), DraftTree(torch.tensor([6]), {}))])
    assert out[0] == NOT_YET and out[1].tokens and tw.requests["long"].session.length == 4
    assert out[1].prefill_beside == 4  # long's chunk shared the forward ("short"'s own prompt token is not counted)
    assert tw.verify_batch([("long", chain(0), DraftTree(root_only, {}))]) == [NOT_YET]  # 4 more, without "short"
    again = DraftTree(torch.tensor([out[1].tokens[-1]]), {})
    assert tw.verify_batch([("short", chain(0), again)])[0].prefill_beside == 4  # forwarded while it was away
    again = DraftTree(torch.tensor([tw.requests["short"].committed[-1]]), {})
    assert tw.verify_batch([("short", chain(0), again)])[0].prefill_beside == 0  # nothing since its last verdict


def _recording_batcher(limits, sizes=None):
    seen = []

    def run_batch(method, calls, caps):
        seen.append((method, [c[0] for c in calls]))
        return [f"{method}:{c[0]}" for c in calls]

    return Batcher(run_batch, lambda m, rid, *a: seen.append((m, [rid])) or m,
                   lambda m, rid, a: (sizes or {}).get(rid, 1), limits), seen


def _concurrently(batcher, calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: batcher.call(*c), calls))


def _wait_until(condition, timeout=5.0):
    deadline = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        deadline.wait(0.01)
    raise AssertionError("timed out")


def test_batcher_limits_order_and_results():
    gate = threading.Event()
    batcher, seen = _recording_batcher(BatchLimits(max_batch_requests=3, max_batch_tokens=10),
                                       sizes={"big": 9, "a": 2, "b": 2})
    record = batcher.run_one
    batcher.run_one = lambda m, rid, *a: (gate.wait(5), record(m, rid, *a))[1]  # "start" holds the loop
    with ThreadPoolExecutor(8) as pool:
        first = pool.submit(batcher.call, "start", "s0")
        _wait_until(lambda: not batcher.queue)  # the loop has taken "start" and waits on the gate
        futures = []
        for method, rid in [("verify", "big"), ("verify", "a"), ("commit", "c"), ("verify", "b"), ("verify", "d")]:
            futures.append(pool.submit(batcher.call, method, rid))
            _wait_until(lambda n=len(futures): len(batcher.queue) == n)  # queued in this order
        gate.set()
        results = [f.result(5) for f in futures]
    assert first.result() == "start"
    assert results == ["verify:big", "verify:a", "commit", "verify:b", "verify:d"]
    # the commit ran before the next forward; "big" (9 of 10 tokens) left no room for "a" (2), and "d" (1)
    # does not jump the queue past "a"; then at most 3 requests
    assert seen == [("start", ["s0"]), ("commit", ["c"]), ("verify", ["big"]), ("verify", ["a", "b", "d"])]
    batcher.close()


def test_batcher_requeues_not_yet_and_fails_each_call_of_a_failed_batch():
    rounds = []

    def run_batch(method, calls, caps):
        rounds.append([c[0] for c in calls])
        if any(c[0] == "boom" for c in calls):
            raise RuntimeError("the forward failed")
        return [NOT_YET if c[0] == "long" and len(rounds) < 3 else c[0] for c in calls]

    batcher = Batcher(run_batch, lambda *a: None, lambda m, rid, a: 1, BatchLimits())
    assert _concurrently(batcher, [("verify", "long"), ("verify", "x")])[0] == "long"
    assert sum("long" in r for r in rounds) == 3  # two chunks, then its verdict
    with pytest.raises(RuntimeError, match="the forward failed"):
        batcher.call("verify", "boom")
    assert batcher.call("verify", "after") == "after"  # the batcher lives on
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.call("verify", "late")


def test_prefill_chunks_fill_the_budget_after_the_decoding_requests_steps():
    """Calls answered NOT_YET (a long prompt, one chunk per forward) went back to the queue's front and were taken
    first: two prompts whose chunks filled max_batch_tokens held a decoding request's step back until both were
    prefilled (25 forwards in the review's run, every one the decoding request's 60 s step timeout ran on). The
    decoding request's step now goes first and the chunks fill the budget left; both prompts still finish."""
    gate, rounds, chunks = threading.Event(), [], {"L1": 5, "L2": 5}

    def run_batch(method, calls, caps):
        rounds.append([c[0] for c in calls])
        if len(rounds) == 1:
            gate.wait(5)  # the first forward (both prompts' first chunks) runs while "d"'s step arrives
        out = []
        for rid, *_ in calls:
            chunks[rid] = chunks.get(rid, 1) - 1
            out.append(NOT_YET if chunks[rid] > 0 else rid)
        return out

    held = threading.Event()
    batcher = Batcher(run_batch, lambda *a: held.wait(5), lambda m, rid, a: 4 if rid.startswith("L") else 1,
                      BatchLimits(max_batch_tokens=8))
    with ThreadPoolExecutor(4) as pool:
        pool.submit(batcher.call, "start", "s0")  # holds the loop until both prompts are queued
        _wait_until(lambda: not batcher.queue)
        longs = []
        for rid in ("L1", "L2"):
            longs.append(pool.submit(batcher.call, "verify", rid))
            _wait_until(lambda n=len(longs): len(batcher.queue) == n)
        held.set()
        _wait_until(lambda: rounds)
        decoding = pool.submit(batcher.call, "verify", "d")
        _wait_until(lambda: len(batcher.queue) == 1)
        gate.set()
        assert decoding.result(5) == "d" and [f.result(5) for f in longs] == ["L1", "L2"]
    assert rounds[:2] == [["L1", "L2"], ["d", "L1"]]  # 1 + 4 tokens; "L2"'s chunk (4 more) waits a forward
    assert sum("L1" in r for r in rounds) == sum("L2" in r for r in rounds) == 5
    batcher.close()


def test_a_prefill_chunk_passed_over_goes_first_in_the_next_forward():
    """Decoding steps first could starve a long prompt: steps that fill max_batch_tokens at every forward (lockstep
    brings them all back before each one) left no room for its chunk until they ended. A chunk passed over once
    goes first in the next forward: the prompt moves one forward in two at least."""
    from sequoia_ray.batching import _Call

    batcher = object.__new__(Batcher)  # its scheduling alone, no loop
    batcher.limits, batcher.size = BatchLimits(max_batch_tokens=8), lambda m, rid, a: 4
    prompt = _Call("verify", "long", ())
    prompt.prefilling = True
    batcher.queue, runs = deque([prompt]), []
    for _ in range(6):  # two decoding requests whose steps (4 tokens each) fill the budget, back before each forward
        queued = {c.request_id for c in batcher.queue}
        batcher.queue.extend(_Call("verify", rid, ()) for rid in ("d1", "d2") if rid not in queued)
        batch, tokens = batcher._take()
        runs.append([c.request_id for c in batch])
        assert tokens <= 8 and len(batch) == 2
        if prompt in batch:
            batcher.queue.appendleft(prompt)  # answered NOT_YET: another chunk to go
    assert ["long" in run for run in runs] == [False, True] * 3, runs


def test_a_decoding_step_joins_every_forward_while_prompts_whose_chunks_fill_the_budget_prefill():
    """Ten long prompts whose whole chunks (256 tokens) fill the 2,048-token budget eight at a time: chunks passed
    over went first, the longest passed over first, so a decoding step waited as many forwards as prompts were
    prefilling. A chunk now joins with its fewest tokens (CHUNK_FLOOR) and is cut to the budget the batch leaves:
    the step joins every forward, every forward stays within the budget and spends all of it, and every prompt
    moves at every forward, none cut short more than CUT_TURNS forwards in a row (12 forwards)."""
    from sequoia_ray.batching import CHUNK_FLOOR, CUT_TURNS, _Call

    batcher = object.__new__(Batcher)
    batcher.limits = BatchLimits(max_batch_tokens=2048)
    batcher.size = lambda m, rid, a: 256 if rid.startswith("L") else 20
    batcher.fewest = lambda m, rid, a: CHUNK_FLOOR if rid.startswith("L") else 20
    prompts = [_Call("verify", f"L{i}", ()) for i in range(10)]
    batcher.queue, moved, cut = deque(prompts), {c.request_id: 0 for c in prompts}, {c.request_id: 0 for c in prompts}
    for _ in range(12):
        if all(c.request_id != "d" for c in batcher.queue):
            batcher.queue.append(_Call("verify", "d", ()))  # the decoding request's next step, back at once
        batch, tokens = batcher._take()
        ran = {c.request_id: (c.cap or batcher.size("verify", c.request_id, ())) for c in batch}
        assert "d" in ran and tokens == sum(ran.values()) == 2048, ran
        assert all(CHUNK_FLOOR <= ran[rid] <= 256 for rid in moved), ran
        for rid in moved:
            moved[rid] += ran[rid]
            cut[rid] = cut[rid] + 1 if ran[rid] < 256 else 0
            assert cut[rid] <= CUT_TURNS, (rid, cut)
        for c in reversed([c for c in batch if c.request_id != "d"]):  # answered NOT_YET: more chunks to go
            c.prefilling = True
            batcher.queue.appendleft(c)
    assert min(moved.values()) >= 3 * 256, moved


def test_a_prompt_beside_steps_that_fill_the_budget_is_not_left_a_floor_a_forward():
    """Eight decoding steps of 30 tokens at every forward of a 256-token budget, beside a 2,048-token prompt in chunks
    of 256: cut to the budget left, its chunks moved CHUNK_FLOOR tokens a forward (114 forwards to prefill it, 15 with
    whole chunks), past the prefill deadline (timeout_s a chunk) wherever a forward takes over 4.2 s. A chunk cut
    short CUT_TURNS forwards in a row goes whole and first in the next: the prompt is prefilled in at most 30
    forwards (26), and no step waits two forwards in a row."""
    from sequoia_ray.batching import CHUNK_FLOOR, _Call

    batcher, left = object.__new__(Batcher), [2048]
    batcher.limits = BatchLimits(max_batch_tokens=256)
    batcher.size = lambda m, rid, a: min(256, left[0]) if rid == "L" else 30
    batcher.fewest = lambda m, rid, a: (CHUNK_FLOOR if left[0] > 256 else left[0]) if rid == "L" else 30
    prompt, runs = _Call("verify", "L", ()), []
    batcher.queue = deque([prompt])
    while left[0] > 0 and len(runs) < 200:
        queued = {c.request_id for c in batcher.queue}
        batcher.queue.extend(_Call("verify", f"d{i}", ()) for i in range(8) if f"d{i}" not in queued)
        batch, tokens = batcher._take()
        assert tokens <= 256
        runs.append({c.request_id for c in batch})
        if prompt in batch:
            left[0] -= prompt.cap or batcher.size("verify", "L", ())
            prompt.prefilling = True
            batcher.queue.appendleft(prompt)
    assert len(runs) <= 30, len(runs)
    for i in range(8):
        skipped = [f"d{i}" not in run for run in runs]
        assert not any(a and b for a, b in zip(skipped, skipped[1:])), (i, skipped)


@pytest.mark.parametrize("where", ["target", "draft"])
def test_a_cut_chunk_forwards_its_cap_and_the_rest_follows(models, where):
    """The batcher's ``caps`` cut a prefill chunk: the worker forwards that many of the prompt's tokens, answers
    NOT_YET, and says the call may be cut to CHUNK_FLOOR (``fewest_tokens_of``); a cap is never taken past the
    chunk, nor below one token."""
    from sequoia_ray.batching import CHUNK_FLOOR
    from sequoia_ray.draft import DraftTree

    target, draft = models
    worker = (TargetWorker if where == "target" else DraftWorker)(target if where == "target" else draft,
                                                                  prefill_chunk=32)
    worker.start("long", list(range(1, 81)), SamplingParams(max_tokens=5), seed=0)
    args = (chain(0), DraftTree(torch.tensor([80]), {})) if where == "target" else (chain(0),)

    def cached():
        req = worker.requests["long"]
        return req.session.length if where == "target" else req.cached

    assert worker.tokens_of("verify", "long", args) == 32
    assert worker.fewest_tokens_of("verify", "long", args) == CHUNK_FLOOR
    run = worker.verify_batch if where == "target" else worker.grow_batch
    for cap, total in [(20, 20), (0, 21), (500, 53)]:
        assert run([("long", *args)], {"long": cap}) == [NOT_YET]
        assert cached() == total
    assert worker.fewest_tokens_of("verify", "long", args) == worker.tokens_of("verify", "long", args)  # the last


@pytest.mark.parametrize("cap", [None, 16, 20])
def test_the_drafts_prefill_count_does_not_depend_on_how_chunks_were_cut(models, cap):
    """``prefilled`` (a tree's ``prefill_beside``, which the live cost model reads) counts the tokens beyond the depth
    + 1 a step accepts: that allowance was taken off every chunk, so the same 100-token prompt counted 96 in whole
    chunks and 94 cut to 16, and a 37-token catch-up after a depth-20 tree 11 whole and 0 cut (a step beside it then
    reported none). Now once a prompt or catch-up: 99 and 16 however cut."""
    _, draft = models
    worker = DraftWorker(draft, prefill_chunk=32)
    caps = {"r": cap} if cap else None

    def grown(*args):
        while isinstance(tree := worker.grow_batch([("r", *args)], caps)[0], str):
            pass
        return tree

    worker.start("r", [3 + i % 90 for i in range(100)], SamplingParams(max_tokens=5), 0)
    assert grown(chain(1)).prefill_beside == worker.prefilled == 99
    worker.finish("r")
    worker.start("r", [5, 6, 7], SamplingParams(max_tokens=100), 0)
    worker.grow("r", chain(20))  # a tree of depth 20, then 37 tokens the target took alone (its root kept)
    assert grown(chain(2), [([0], [9] * 37, 3)]).prefill_beside == 37 - 21  # less the depth + 1 a step accepts


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_failed_grow_retries_only_the_calls_it_left_unanswered(models, monkeypatch, temperature):
    """A batched grow whose second forward (a tree level) fails is retried request by request: a prompt whose chunk
    the first forward had prefilled forwarded a second chunk in its retry (its cache 40 tokens for a cap of 20). Only
    the calls the batch left unanswered are retried; the other's tree is the one it grows alone (sampled: the same
    draws, its generator as it was before the batch)."""
    import sequoia_ray.draft as draft_module

    _, draft = models
    params, plan = SamplingParams(max_tokens=20, temperature=temperature, seed=7), k_ary(2, 2)
    prompts = {"A": [3 + i % 90 for i in range(80)], "B": [5, 6, 7]}
    batched, alone = DraftWorker(draft, prefill_chunk=32), DraftWorker(draft, prefill_chunk=32)
    for worker in (batched, alone):
        for seed, (rid, prompt) in enumerate(prompts.items()):
            worker.start(rid, prompt, params, seed)
    real, forwards = draft_module.hidden_many, []

    def failing(*args):
        forwards.append(len(args[1]))
        if len(forwards) == 2:
            raise RuntimeError("injected: the first tree level's forward")
        return real(*args)

    monkeypatch.setattr(draft_module, "hidden_many", failing)
    out = batched.grow_batch([("A", plan), ("B", plan)], {"A": 20})
    monkeypatch.setattr(draft_module, "hidden_many", real)
    assert forwards[:2] == [2, 1] and out[0] == NOT_YET and batched.requests["A"].cached == 20
    assert torch.equal(out[1].tokens, alone.grow("B", plan).tokens)


def test_prompts_cut_to_the_budget_left_decode_as_the_target_alone(models):
    """Six prompts of 40-63 tokens prefilled in chunks of 24 through batchers of 64 tokens, beside two short ones:
    chunks are cut to the budget left (at a forward with two short requests' trees, a 24-token chunk does not
    fit whole). Greedy output equals the target alone's; the batchers did cut chunks."""
    target, draft = models
    pair = _Pair(target, draft, BatchLimits(max_batch_tokens=64), prefill_chunk=24)
    cuts = []
    for batcher in (pair.target_batcher, pair.draft_batcher):
        run = batcher.run_batch
        batcher.run_batch = lambda m, calls, caps, run=run: cuts.append(dict(caps)) or run(m, calls, caps)
    prompts = [[(r * 11 + i * 5) % 97 for i in range(40 + 4 * r)] for r in range(6)] + ragged_prompts(2)
    params = [SamplingParams(max_tokens=8, seed=r) for r in range(8)]
    try:
        got = pair.run(PLAN, list(zip(prompts, params)))
    finally:
        pair.close()
    for prompt, p, ids in zip(prompts, params, got):
        assert ids == _alone(target, None, chain(0), prompt, p)
    assert any(cuts), "no chunk was cut"


@pytest.mark.parametrize("chunk,limits", [(8, BatchLimits(max_batch_tokens=8)),
                                          (4, BatchLimits(max_batch_tokens=16, max_batch_requests=1))])
def test_prompts_passed_over_in_turn_do_not_crowd_out_a_decoding_step(chunk, limits):
    """Two long prompts whose chunks each fill the budget (prefill_chunk == max_batch_tokens), or one request per
    forward: a chunk passed over went first, so the two prompts took turns at the front and the decoding step ran
    once, then not again until both were prefilled (40 forwards in the review's run, past the step timeout on a
    CPU). Any call passed over goes first, the longest first: the step runs one forward in three at least."""
    from sequoia_ray.batching import _Call

    batcher = object.__new__(Batcher)
    batcher.limits, batcher.size = limits, lambda m, rid, a: chunk if rid.startswith("L") else 1
    prompts = [_Call("verify", rid, ()) for rid in ("L1", "L2")]
    for c in prompts:
        c.prefilling = True
    batcher.queue, runs = deque(prompts), []
    for _ in range(12):
        if all(c.request_id != "d" for c in batcher.queue):
            batcher.queue.append(_Call("verify", "d", ()))  # the decoding request's next step, back at once
        batch, _ = batcher._take()
        runs.append("".join("D" if c.request_id == "d" else "L" for c in batch))
        batcher.queue.extendleft(reversed([c for c in batch if c.request_id != "d"]))  # NOT_YET: more chunks
    steps = [i for i, run in enumerate(runs) if "D" in run]
    assert max(b - a for a, b in zip([-1] + steps, steps + [len(runs)])) <= 3, runs
    assert sum(run.count("L") for run in runs) >= 6  # the prompts move too


def test_a_request_that_stops_calling_never_stalls_the_others(models):
    """A client that stops reading stops its own steps only: nobody waits for its next call."""
    target, draft = models
    pair = _Pair(target, draft)
    try:
        idle = pair.decoder(PLAN).stream([1, 2, 3], SamplingParams(max_tokens=40))
        next(idle)  # one chunk read, then the client goes quiet with its request open
        got = pair.run(PLAN, [(p, SamplingParams(max_tokens=10)) for p in ragged_prompts(3)])
        assert [len(ids) for ids in got] == [10, 10, 10]
        idle.close()
    finally:
        pair.close()


def test_bad_limits_are_named():
    with pytest.raises(ValueError, match="max_batch_requests 0 must be >= 1"):
        BatchLimits(max_batch_requests=0)
    with pytest.raises(ValueError, match="max_batch_tokens -1"):
        BatchLimits(max_batch_tokens=-1)


def test_commits_folded_into_grow_apply_once_even_when_a_prefill_chunk_sends_the_grow_again(models):
    """The engine sends a step's verdict with the next grow; a grow answered NOT_YET (a prefill chunk) comes
    back with the same commits, which must not be applied twice. 6 root-only steps pile up 6 commits, more
    than the 4-token chunk, so the regrow really is chunked."""
    target, draft = models
    prompt = [3, 1, 4, 1, 5]
    chunked = DraftWorker(draft, prefill_chunk=4)
    plain = DraftWorker(draft)
    params = SamplingParams(max_tokens=20)
    for w in (chunked, plain):
        w.start("r", prompt, params, seed=0)
    tree = chunked.grow("r", PLAN)
    assert plain.grow("r", PLAN).tokens.tolist() == tree.tokens.tolist()
    commits, at = [([0, 1], [int(tree.tokens[1]), 7], len(prompt))], len(prompt) + 2
    for token in range(8, 14):  # target-alone steps: one token each, no tree in between
        commits.append(([0], [token], at))
        at += 1
    calls = [("r", PLAN, list(commits))]
    rounds = 0
    while (out := chunked.grow_batch(calls)[0]) == NOT_YET:
        rounds += 1
    assert rounds >= 1, "the regrow was not chunked"
    assert out.tokens.tolist() == plain.grow("r", PLAN, list(commits)).tokens.tolist()
    assert chunked.requests["r"].committed == plain.requests["r"].committed == prompt + [int(tree.tokens[1]), 7, *range(8, 14)]
    with pytest.raises(ValueError, match="commit at token 99 but request 'r' has 13 tokens"):
        chunked.commit("r", [0], [1], 99)


def test_a_sliding_window_model_is_refused_up_front():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    model = Qwen2ForCausalLM(cfg).eval()
    for worker in (TargetWorker, DraftWorker):
        with pytest.raises(ValueError, match="sliding-window attention in layers"):
            worker(model)


def test_a_request_whose_solo_retry_fails_too_fails_alone(models, monkeypatch):
    """The batched forward fails; the retry one by one fails again for request "1" only: it gets the error
    and its cache is back at its committed tokens, the others get their verdicts alone."""
    target, draft = models
    tw, dw = _started(target, draft, 3)
    ref_t, ref_d = _started(target, draft, 3)
    trees = dw.grow_batch([(str(r), PLAN) for r in range(3)])
    import sequoia_ray.target as target_module

    real, poisoned = target_module.hidden_many, tw.requests["1"].session

    def flaky(model, segments, layout):
        if len(segments) > 1 or segments[0].session is poisoned:
            raise RuntimeError("out of memory")
        return real(model, segments, layout)

    monkeypatch.setattr(target_module, "hidden_many", flaky)
    out = tw.verify_batch([(str(r), PLAN, trees[r]) for r in range(3)])
    assert isinstance(out[1], RuntimeError)
    assert [out[0], out[2]] == [ref_t.verify(r, PLAN, ref_d.grow(r, PLAN)) for r in ("0", "2")]
    assert poisoned.length == 0 and tw.requests["1"].committed == ragged_prompts(3)[1]  # nothing of the step kept


def test_a_tp_rank_never_retries_alone(models, monkeypatch):
    target, draft = models
    tw = TargetWorker(target, retry_alone=False)
    dw = DraftWorker(draft)
    for r in ("0", "1"):
        tw.start(r, [1, 2, 3], SamplingParams(max_tokens=5), seed=0)
        dw.start(r, [1, 2, 3], SamplingParams(max_tokens=5), seed=0)
    trees = dw.grow_batch([("0", PLAN), ("1", PLAN)])
    import sequoia_ray.target as target_module

    monkeypatch.setattr(target_module, "hidden_many", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # the peers are inside the batched collectives: fail the batch
        tw.verify_batch([("0", PLAN, trees[0]), ("1", PLAN, trees[1])])


def test_a_request_twice_in_the_queue_goes_into_two_forwards():
    gate = threading.Event()
    batcher, seen = _recording_batcher(BatchLimits())
    record = batcher.run_one
    batcher.run_one = lambda m, rid, *a: (gate.wait(5), record(m, rid, *a))[1]
    with ThreadPoolExecutor(4) as pool:
        pool.submit(batcher.call, "start", "s")
        _wait_until(lambda: not batcher.queue)
        futures = []
        for rid in ("a", "a", "b"):
            futures.append(pool.submit(batcher.call, "verify", rid))
            _wait_until(lambda n=len(futures): len(batcher.queue) == n)
        gate.set()
        [f.result(5) for f in futures]
    assert seen[1:] == [("verify", ["a"]), ("verify", ["a", "b"])]
    batcher.close()


def test_a_malformed_batch_result_fails_its_calls_and_the_batcher_lives_on():
    answers = iter([[], ["ok"]])  # first batch: no result for its one call
    batcher = Batcher(lambda m, calls, caps: next(answers), lambda *a: None, lambda m, rid, a: 1, BatchLimits())
    with pytest.raises(RuntimeError, match="a batch of 1 calls returned 0 results"):
        batcher.call("verify", "x")
    assert batcher.call("verify", "y") == "ok" and batcher.thread.is_alive()
    batcher.close()


def test_a_call_on_a_dead_batcher_thread_fails_instead_of_waiting_for_ever():
    batcher = Batcher(lambda m, calls, caps: [], lambda *a: None, lambda m, rid, a: 1, BatchLimits())
    batcher.close()
    batcher.thread.join(5)
    batcher.closed = False  # as if the thread had died on its own
    with pytest.raises(RuntimeError, match="thread has died"):
        batcher.call("verify", "x")


def test_the_reaper_never_frees_a_request_whose_call_waited_in_the_queue():
    from actors.reaper import Reaper
    from tests.serving import Clock

    clock = Clock()
    reaper = Reaper(5.0, clock)
    reaper.touch("waited")
    reaper.touch("gone")
    clock.now = 9  # both idle 9 s > 5 s; "waited" has a call in this batch
    assert reaper.due("verify", ["waited"]) == ["gone"]
    assert "waited" in reaper.last


def test_tp_ranks_agree_on_equal_results_and_exceptions_and_disagree_otherwise():
    from actors.target import TargetRank
    from sequoia_ray.verify import Verdict

    mine = [Verdict([0, 1], [5, 6]), ValueError("bad tree"), NOT_YET]
    TargetRank._check_agree("verify", mine, [[Verdict([0, 1], [5, 6]), ValueError("bad tree"), NOT_YET]])
    for other in ([Verdict([0], [5]), ValueError("bad tree"), NOT_YET],
                  [Verdict([0, 1], [5, 6]), KeyError("bad tree"), NOT_YET]):
        with pytest.raises(RuntimeError, match="ranks disagree on a batched verify of 3 requests"):
            TargetRank._check_agree("verify", mine, [other])


def test_the_plan_may_change_at_every_step_even_to_root_only(models):
    """A server picks each step's plan from the current batch size: trees of different sizes, and root-only
    steps (no draft call; their verdicts reach the draft with its next grow), must keep greedy exact."""
    target, draft = models
    plans = [PLAN, chain(0), chain(0), k_ary(2, 2), chain(3), chain(0)]
    asked = []

    def plan_for_step():
        asked.append(len(asked))
        return plans[len(asked) % len(plans)]

    spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), plan_for_step)
    for prompt in ragged_prompts(3):
        params = SamplingParams(max_tokens=30)
        out = spec.generate(prompt, params)
        assert out.token_ids == _alone(target, None, chain(0), prompt, params)
        assert len(asked) >= out.stats.steps  # asked at every step
        assert out.stats.tokens_per_step > 1.0  # the tree steps really speculated


def _clients(batcher, rids, rounds, turnaround_s, stop_after=None, stagger_s=0.0):
    """Each request calls verify ``rounds`` times, ``turnaround_s`` between a result and its next call (the trip
    back through the caller); ``stop_after`` {rid: n}: that request goes quiet after n calls; the i-th request
    starts ``i * stagger_s`` after the first."""
    def client(rid):
        time.sleep(stagger_s * rids.index(rid))
        for k in range(rounds):
            if stop_after and k >= stop_after.get(rid, rounds):
                return
            batcher.call("verify", rid)
            time.sleep(turnaround_s)

    with ThreadPoolExecutor(len(rids)) as pool:
        list(pool.map(client, rids))


def _slow_batcher(wait_s, forward_s=0.05, comes_back=lambda method, args: True, lookback=1, gather_s=0.0):
    def run_batch(method, calls, caps):
        time.sleep(forward_s)
        return [c[0] for c in calls]

    return Batcher(run_batch, lambda *a: None, lambda m, rid, a: 1, BatchLimits(wait_s=wait_s, gather_s=gather_s),
                   comes_back=comes_back, lookback=lookback)


def _mean_batch(batcher):
    stats = batcher.stats()
    return sum(b * n for b, n in stats.items()) / sum(stats.values())


def test_only_requests_that_come_straight_back_are_waited_for():
    """Two requests, two batchers (a draft's ``grow`` and a target's ``verify``, 50 ms forwards, a 5 s wait).
    Target-alone steps (root-only verifies) come straight back: they share every forward. Tree steps go
    grow -> verify -> grow: nobody waits for them, so they fall into alternate groups (one request per forward,
    one drafting while the other verifies), without ever waiting. 2 x 16 steps per case. Waiting for them too
    (the old rule: every call taken as coming back) either holds them in lockstep (both in every forward, each
    batcher idle while the other runs; ~1.9 requests a forward) or, when one request is held in each batcher
    waiting for the other, stalls every step for the whole wait: either fails the second case."""
    root, tree = SimpleNamespace(n=1), SimpleNamespace(n=8)

    def steps(batchers, rids, calls):
        def client(rid):
            time.sleep(0.025 * rids.index(rid))  # "b" starts half a forward after "a"
            for _ in range(16):
                for batcher, (method, plan) in zip(batchers, calls):
                    batcher.call(method, rid, plan)
                    time.sleep(0.002)

        with ThreadPoolExecutor(len(rids)) as pool:
            list(pool.map(client, rids))
        return [_mean_batch(b) for b in batchers]

    alone = [_slow_batcher(2.0, comes_back=comes_straight_back)]
    assert steps(alone, ["a", "b"], [("verify", root)])[0] > 1.5  # the first forward starts alone
    pipelined = [_slow_batcher(5.0, comes_back=comes_straight_back) for _ in range(2)]
    start = time.monotonic()
    sizes = steps(pipelined, ["a", "b"], [("grow", tree), ("verify", tree)])
    elapsed = time.monotonic() - start
    # ~1.0 (32 calls, ~31 forwards); 16 steps of 2 x 50 ms forwards take ~1.7 s, a single 5 s wait would show
    assert max(sizes) < 1.3 and elapsed < 5.0, (sizes, elapsed)
    for b in alone + pipelined:
        b.close()


def test_tree_requests_waited_for_step_in_lockstep():
    """``batch_wait_trees``: the target waits (5 s here) for the previous forward's tree requests, which come
    back after one ``grow``; the draft only gathers its returning calls (``GATHER_S``). Two tree requests
    starting half a forward apart (the case that alternates in the test above) merge: after a step or two both
    are in every forward of both batchers. 16 steps of 2 x 50 ms take ~1.7 s; a 5 s wait, or both batchers each
    waiting for the request the other holds at every step, would show. The draft gathers for 50 ms only, so a
    client more than that late splits one of its forwards: nominally 18 forwards (1.78 a call), and the bound,
    1.6, allows two more (alternating gives ~1.0)."""
    tree = SimpleNamespace(n=8)
    draft = _slow_batcher(0.0, gather_s=GATHER_S, comes_back=comes_back_after_any_step, lookback=LOCKSTEP_LOOKBACK)
    target = _slow_batcher(5.0, gather_s=GATHER_S, comes_back=comes_back_after_any_step, lookback=LOCKSTEP_LOOKBACK)

    def client(rid):
        time.sleep(0.025 * ["a", "b"].index(rid))
        for _ in range(16):
            draft.call("grow", rid, tree)
            time.sleep(0.002)
            target.call("verify", rid, tree)
            time.sleep(0.002)
        for batcher in (draft, target):
            batcher.call("finish", rid)  # a finished request is not waited for

    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(client, ["a", "b"]))
    elapsed = time.monotonic() - start
    sizes = [_mean_batch(b) for b in (draft, target)]
    # 32 calls each: in lockstep 16-18 forwards (>= 1.78 a forward); alternating ~31 (~1.0)
    assert min(sizes) >= 1.6 and elapsed < 4.5, (sizes, elapsed)
    draft.close()
    target.close()


def test_comes_back_after_any_step():
    tree = SimpleNamespace(n=8)
    assert comes_back_after_any_step("verify", (tree, None)) and comes_back_after_any_step("grow", (tree,))
    assert comes_back_after_any_step("start", ("prompt",))  # a started request's first grow or verify comes next
    assert not comes_back_after_any_step("commit", ())


def test_a_start_arriving_during_a_wait_does_not_cut_it_short():
    """"a" and "b" shared the last forward and come straight back; "a" is queued, "b" is on its way. A new
    request's ``start`` runs at once, and the forward still waits for "b" instead of running "a" alone."""
    batcher, seen = _recording_batcher(BatchLimits(wait_s=2.0))
    with batcher.cond:
        batcher.recent.append({"a", "b"})
        batcher.last_end = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        a = pool.submit(batcher.call, "verify", "a", SimpleNamespace(n=1))
        _wait_until(lambda: batcher.queue)
        assert pool.submit(batcher.call, "start", "c").result(timeout=5) == "start"
        time.sleep(0.05)
        b = pool.submit(batcher.call, "verify", "b", SimpleNamespace(n=1))
        assert (a.result(timeout=5), b.result(timeout=5)) == ("verify:a", "verify:b")
    assert seen == [("start", ["c"]), ("verify", ["a", "b"])]
    batcher.close()


@pytest.mark.parametrize("lockstep", [True, False])
def test_in_lockstep_a_request_started_while_the_others_gather_joins_their_forward(lockstep):
    """The draft in lockstep: "a" and "b" shared its last forward and are queued again; "c", new, is started and
    its first ``grow`` comes a round trip (30 ms) later, within the gather (200 ms here). Started, "c" is
    expected like a request of the last forward, so the three share one forward; before, the forward ran "a" and
    "b" at once and "c" alone after them (served at 8 clients: 22 of 149 draft forwards were such stragglers,
    each ~140 ms). Without the lockstep guess (``comes_straight_back``) a start changes nothing."""
    policy = dict(comes_back=comes_back_after_any_step, lookback=LOCKSTEP_LOOKBACK) if lockstep else {}
    seen = []

    def run_batch(method, calls, caps):
        seen.append((method, [c[0] for c in calls]))
        return [c[0] for c in calls]

    batcher = Batcher(run_batch, lambda m, rid, *a: seen.append((m, [rid])), lambda m, rid, a: 1,
                      BatchLimits(gather_s=0.2), **policy)
    with batcher.cond:
        batcher.recent.append({"a", "b"})
    tree = SimpleNamespace(n=8)
    with ThreadPoolExecutor(3) as pool:
        a = pool.submit(batcher.call, "grow", "a", tree)
        _wait_until(lambda: batcher.queue or seen)
        pool.submit(batcher.call, "start", "c").result(timeout=5)
        b = pool.submit(batcher.call, "grow", "b", tree)
        time.sleep(0.03)
        c = pool.submit(batcher.call, "grow", "c", tree)
        assert [f.result(timeout=5) for f in (a, b, c)] == ["a", "b", "c"]
    forwards = [rids for method, rids in seen if method == "grow"]
    assert forwards == ([["a", "b", "c"]] if lockstep else [["a", "b"], ["c"]]), seen
    # a started request that never calls is waited for no longer than one of the last forward's
    with batcher.cond:
        batcher.recent.clear()
    batcher.call("start", "quiet")
    start = time.monotonic()
    for _ in range(3):
        assert batcher.call("grow", "a", tree) == "a"
    assert time.monotonic() - start < (LOCKSTEP_LOOKBACK + 1) * 0.2 + 0.5
    batcher.close()


def test_comes_straight_back_and_a_failing_guess():
    assert comes_straight_back("verify", (SimpleNamespace(n=1), None))
    assert not comes_straight_back("verify", (SimpleNamespace(n=2), None))
    assert not comes_straight_back("grow", (SimpleNamespace(n=1),))
    assert not comes_straight_back("verify", ())

    def broken(method, args):
        raise KeyError("no plan")

    batcher = _slow_batcher(5.0, forward_s=0.0, comes_back=broken)
    _clients(batcher, ["a"], 3, 0.0)
    assert batcher.expected == set()  # a guess that fails is "not coming back": nobody is waited for
    batcher.close()


def test_a_wait_lets_requests_share_forwards_instead_of_alternating():
    """2 requests, "b" starting half a forward after "a", 50 ms forwards, 5 ms back: without a wait they
    alternate (one request per forward: each comes back while the other's forward runs); waiting up to 200 ms
    for the previous forward's requests puts both in every forward from the second on: 13 forwards for 24
    calls (1.85 a forward; the last, "b"'s, waits once for "a", which has finished). The bound, 1.65, allows one
    forward more, from a client back later than the wait (with a 30 ms wait a single 25 ms stall on a loaded host
    could do that). (Started together, whether they alternate without a wait is up to thread timing: the CI once saw
    1.41 requests a forward.)"""
    sizes = {}
    for wait_s in (0.0, 0.2):
        batcher = _slow_batcher(wait_s)
        _clients(batcher, ["a", "b"], 12, 0.005, stagger_s=0.025)
        sizes[wait_s] = _mean_batch(batcher)
        batcher.close()
    assert sizes[0.0] < 1.4 and sizes[0.2] > 1.65, sizes


def test_a_request_that_stops_calling_is_waited_for_once_only():
    """Request "c" goes quiet after 2 calls: the next forward waits for it (1 s) once, then never again. (At
    the end, whichever of "a" and "b" finishes last may wait once for the other: 2 waits, ~2.3 s in all.)"""
    batcher = _slow_batcher(1.0, forward_s=0.02)
    start = time.monotonic()
    _clients(batcher, ["a", "b", "c"], 12, 0.002, stop_after={"c": 2})
    elapsed = time.monotonic() - start
    batcher.close()
    assert elapsed < 12 * 0.02 + 4 * 1.0, elapsed  # waiting at every forward would take 10 x 1 s or more


def test_a_call_that_failed_is_not_waited_for():
    """A caller timed out and abandoned its request (its finish queued behind its own verify, still waiting):
    the verify then fails (unknown request) and the request will not come back. The next forward must not wait
    ``wait_s`` for it (it did: every call of a forward was taken as coming back, failed ones too)."""
    gate, known, root = threading.Event(), {"x", "y"}, SimpleNamespace(n=1)  # root-only verifies come back

    def run_batch(method, calls, caps):
        gate.wait(5)
        return [c[0] if c[0] in known else KeyError(f"unknown {c[0]}") for c in calls]

    def run_one(method, request_id, *args):
        known.discard(request_id)

    batcher = Batcher(run_batch, run_one, lambda method, rid, args: 1, BatchLimits(wait_s=2.0))
    with ThreadPoolExecutor(3) as pool:
        held = pool.submit(batcher.call, "verify", "y", root)  # forward 1, held
        time.sleep(0.1)
        stale = pool.submit(batcher.call, "verify", "x", root)  # x's verify queues; its caller gives up
        time.sleep(0.1)
        pool.submit(batcher.call, "finish", "x")
        time.sleep(0.1)
        gate.set()
        held.result(5)
        with pytest.raises(KeyError):
            stale.result(5)
    assert "x" not in batcher.expected
    start = time.monotonic()
    batcher.call("verify", "y", root)
    assert time.monotonic() - start < 1.0  # no 2 s wait for x
    batcher.close()


def test_a_trees_prefill_beside_counts_the_drafts_catch_up(models):
    """A request's steps: 2 trees, 6 steps of the target alone, 2 trees (plan depth 3). The first tree's step
    forwards the prompt in the draft and the first tree after the target alone forwards the 6 tokens the draft
    missed: both are flagged (the draft's catch-up beyond the depth + 1 tokens a tree step can accept); the
    trees that follow a tree are not, nor the target-alone steps."""
    from sequoia_ray.engine import ROOT_ONLY

    target, draft = models
    seen = []

    class Scripted:
        def plan(self, base):
            return ROOT_ONLY if 2 <= len(seen) < 8 else base

        def observe(self, plan, verdict, seconds):
            seen.append((plan.n > 1, verdict.prefill_beside))

    prompt = ragged_prompts(4)[3]  # 11 tokens
    spec = SpeculativeDecoder(TargetWorker(target), DraftWorker(draft), PLAN, policy=lambda params: Scripted())
    spec.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    assert [tree for tree, _ in seen[:10]] == [True, True] + [False] * 6 + [True, True]
    beside = [b for _, b in seen]
    assert beside[0] >= len(prompt) - 1 - 0 and beside[8] > 0, seen  # the prompt; the 6 tokens missed
    assert beside[1] == 0 and beside[2:8] == [0] * 6 and beside[9:] == [0] * len(beside[9:]), seen


def test_utilization_counts_the_time_batches_ran():
    """Ten 50 ms forwards with 50 ms of nothing between them: about half the batcher's time was busy (the
    bounds allow a loaded machine, whose sleeps overshoot: busy >= 0.5 s, and under 85% of the time passed)."""
    batcher = _slow_batcher(0.0, forward_s=0.05, comes_back=lambda method, args: False)
    try:
        start = batcher.utilization()
        assert start["busy_s"] == 0.0
        for i in range(10):
            batcher.call("verify", f"r{i}", SimpleNamespace(n=1), None)
            time.sleep(0.05)
        used = batcher.utilization()
        elapsed = used["running_s"] - start["running_s"]
        assert elapsed >= 1.0 and 0.5 <= used["busy_s"] < 0.85 * elapsed  # the idle gaps are not busy
    finally:
        batcher.close()


def test_the_trace_records_each_batch_in_order_with_its_tree_calls():
    """Three batches one after the other (30 ms forwards): a root-only verify, a tree verify and a grow. Each is
    one trace entry with its method, request count and tree calls, its times in order and at least as long as
    the forward; ``since`` keeps the batches that began at or after it."""
    batcher = _slow_batcher(0.0, forward_s=0.03, comes_back=lambda method, args: False)
    try:
        since = time.monotonic()
        batcher.call("verify", "r0", SimpleNamespace(n=1), None)
        batcher.call("verify", "r1", SimpleNamespace(n=4), None)
        batcher.call("grow", "r2", None)
        trace = batcher.trace(since)
        assert [(f.method, f.calls, f.trees) for f in trace] == [("verify", 1, 0), ("verify", 1, 1), ("grow", 1, 1)]
        assert all(since <= f.queued <= f.start < f.end for f in trace)
        assert all(a.end <= b.start for a, b in zip(trace, trace[1:]))
        assert all(f.end - f.start >= 0.03 for f in trace)
        assert batcher.trace(trace[-1].start) == trace[-1:]
        assert batcher.trace(trace[-1].end + 1) == []
    finally:
        batcher.close()


def test_the_trace_counts_tree_calls_in_a_shared_batch():
    """Two tree verifies and a root-only one queued while a forward runs go in one batch: 3 calls, 2 trees,
    4 + 1 + 8 tokens; the batch gathered from its first call's arrival, while the forward before it ran."""
    started, gate = threading.Event(), threading.Event()

    def run_batch(method, calls, caps):
        started.set()
        gate.wait(5)
        return [c[0] for c in calls]

    batcher = Batcher(run_batch, lambda *a: None, lambda m, rid, a: a[0].n, BatchLimits())  # tokens: the tree's n
    try:
        with ThreadPoolExecutor(4) as pool:
            held = pool.submit(batcher.call, "verify", "r0", SimpleNamespace(n=1), None)
            assert started.wait(5)
            calls = [pool.submit(batcher.call, "verify", rid, SimpleNamespace(n=n), None)
                     for rid, n in (("r1", 4), ("r2", 1), ("r3", 8))]
            deadline = time.monotonic() + 5
            while len(batcher.queue) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
            gate.set()
            assert [c.result(timeout=5) for c in [held, *calls]] == ["r0", "r1", "r2", "r3"]
        first, second = batcher.trace()
        assert [(f.calls, f.trees, f.tokens) for f in (first, second)] == [(1, 0, 1), (3, 2, 13)]
        assert second.start - second.queued >= 0.05 and second.queued < first.end
    finally:
        batcher.close()
