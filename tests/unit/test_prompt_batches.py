"""A completion's ``prompt`` as an array of prompts (LangChain's ``OpenAI.generate`` and lm-eval's local-completions
send them; OpenAI's and vLLM's completions take them), and ``n`` choices per prompt: one choice per prompt and j,
generated side by side, all or none. Both were refused (400) before. The request path is the real one (_prepare, _chunks, _events) over a tiny
in-process pair, as in test_handle_api; ``deployments.prompt_batch``'s helpers are tested on plain streams."""

from __future__ import annotations

import asyncio

import pytest

from deployments import openai_api as api
from deployments.prompt_batch import all_or_none, merged
from tests.unit.test_handle_api import pair, replica  # noqa: F401 - the module-scoped fixture

PROMPTS = ["def add(a, b):", "Once upon a time", "hello"]


def complete(r, **body) -> dict:
    return asyncio.run(r.generate({"model": "m", "max_tokens": 6, **body}))


def stream(r, **body) -> list[dict]:
    async def collect():
        return [e async for e in r.generate_stream({"model": "m", "max_tokens": 6, **body})]

    return asyncio.run(collect())


# ---- through the ingress ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.6, 7)])
def test_each_choice_is_its_prompt_generated_alone(pair, temperature, seed):  # noqa: F811
    """Greedy, and sampled with a seed (each prompt its own generator): a batch's choice i is what prompt i alone
    gives, in order; the usage adds the prompts' and the choices' tokens."""
    r = replica(pair)
    alone = [complete(r, prompt=p, temperature=temperature, seed=seed) for p in PROMPTS]
    batch = complete(r, prompt=PROMPTS, temperature=temperature, seed=seed)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert [c["finish_reason"] for c in batch["choices"]] == [a["choices"][0]["finish_reason"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone)
    spec = batch["usage"]["speculative"]
    assert spec["steps"] == sum(a["usage"]["speculative"]["steps"] for a in alone)
    assert spec["tokens"] == batch["usage"]["completion_tokens"]
    assert r.active == 0


def test_a_batchs_prompts_are_distinct_requests_on_workers_shared_as_the_actors_are(pair):  # noqa: F811
    """The actors hold every request's state by its id: a batch's prompts sent under the request's one id
    overwrote each other's state there. Here one target and one draft worker serve every decoder, as the actors
    serve every request of a replica."""
    from sequoia_ray.draft import DraftWorker
    from sequoia_ray.engine import SpeculativeDecoder
    from sequoia_ray.target import TargetWorker

    r = replica(pair)
    target, draft = TargetWorker(pair.target.model), DraftWorker(pair.draft.model)

    async def shared(plan, speculate, family=None, rules=None):
        return SpeculativeDecoder(target, draft if speculate else None, plan(), tokenizer=pair.target.tokenizer,
                                  eos_ids=pair.target.eos_ids, max_context=pair.target.max_context)

    alone = [complete(r, prompt=p, temperature=0, max_tokens=12) for p in PROMPTS]
    r._decoder = shared
    batch = complete(r, prompt=PROMPTS, temperature=0, max_tokens=12)
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert not target.requests and not draft.requests  # every prompt's state freed


def test_a_batch_of_token_arrays_is_served_as_its_texts_are(pair):  # noqa: F811
    r = replica(pair)
    ids = [r.tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS[:2]]
    by_ids = complete(r, prompt=ids, temperature=0)
    by_text = complete(r, prompt=PROMPTS[:2], temperature=0)
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    assert by_ids["usage"]["prompt_tokens"] == sum(map(len, ids))


@pytest.mark.parametrize("include_usage", [True, False])
def test_a_streamed_batch_interleaves_its_choices_by_index(pair, include_usage):  # noqa: F811
    """Every event names its choice; a choice's texts joined are its completion; one finish per choice; the
    request's usage once, at the end (a usage-only chunk with ``include_usage``, else on the last finish)."""
    r = replica(pair)
    whole = complete(r, prompt=PROMPTS, temperature=0)
    events = stream(r, prompt=PROMPTS, temperature=0, stream_options={"include_usage": include_usage})
    choices = [e["choices"][0] for e in events if e["choices"]]
    texts = ["".join(c["text"] for c in choices if c["index"] == i) for i in range(3)]
    assert texts == [c["text"] for c in whole["choices"]]
    assert sorted(c["index"] for c in choices if c["finish_reason"]) == [0, 1, 2]
    with_usage = [e for e in events if e.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is events[-1]
    assert with_usage[0]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert (events[-1]["choices"] == []) == include_usage
    assert r.active == 0


def peak_in_flight(r) -> list[int]:
    """The replica's requests in flight, recorded at every admission (its peak: ``max`` of the list)."""
    seen, stream = [], r.runner.stream

    def counted(*args, **kwargs):  # a choice starts generating, its slot held (taken, or handed on by one that ended)
        seen.append(r.active)
        return stream(*args, **kwargs)

    r.runner.stream = counted
    return seen


@pytest.mark.parametrize("streamed", [False, True])
def test_a_batch_larger_than_max_concurrent_runs_through_its_slots(pair, streamed):  # noqa: F811
    """Three prompts at max_concurrent 2 (LangChain sends 20 a request; the default is 8): a 400 before. The
    choices take slots as they free, never more than max_concurrent at once, and each is its prompt alone."""
    r = replica(pair, max_concurrent=2)
    alone = [complete(r, prompt=p, temperature=0)["choices"][0]["text"] for p in PROMPTS]
    seen = peak_in_flight(r)
    if streamed:
        events = stream(r, prompt=PROMPTS, temperature=0)
        texts = ["".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
                 for i in range(3)]
    else:
        texts = [c["text"] for c in complete(r, prompt=PROMPTS, temperature=0)["choices"]]
    assert texts == alone and len(seen) == 3 and max(seen) == 2 and r.active == 0


def test_a_batch_larger_than_the_free_slots_waits_for_them_and_a_full_replica_refuses_it(pair):  # noqa: F811
    """With one of three slots busy, a batch of three runs two at a time; with every slot busy it is a 429, as a
    single request is (nothing started)."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True}

    async def scenario(max_concurrent: int):
        r = replica(pair, max_concurrent=max_concurrent)
        busy = r.generate_stream(chat)
        await busy.__anext__()  # holds one slot
        seen = peak_in_flight(r)
        try:
            out = await r.generate({"model": "m", "prompt": PROMPTS, "max_tokens": 4, "temperature": 0})
            return len(out["choices"]), max(seen), r.active
        except api.APIError as refused:
            return refused.status, seen, r.active
        finally:
            await busy.aclose()

    assert asyncio.run(scenario(3)) == (3, 3, 1)  # never more than max_concurrent, the busy request among them
    assert asyncio.run(scenario(1)) == (429, [], 1)


def test_a_client_gone_while_its_choices_wait_for_slots_frees_everything(pair):  # noqa: F811
    r = replica(pair, max_concurrent=2)

    async def scenario():
        batch = asyncio.ensure_future(r.generate({"model": "m", "prompt": PROMPTS, "max_tokens": 200,
                                                  "ignore_eos": True, "temperature": 0}))
        while r.active < 2:  # two choices running, the third waiting for a slot
            await asyncio.sleep(0.01)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        await r.runner.drain(10)
        return r.active

    assert asyncio.run(scenario()) == 0


@pytest.mark.parametrize("body, param", [({"prompt": ["x"] * 257}, "prompt"), ({"prompt": ["x"] * 2, "n": 129}, "n")])
def test_more_choices_than_a_request_may_ask_for_is_a_400(pair, body, param):  # noqa: F811
    with pytest.raises(api.APIError) as info:
        complete(replica(pair), **body)
    assert (info.value.status, info.value.param) == (400, param) and "256 choices" in info.value.message


@pytest.mark.parametrize("streamed", [False, True])
def test_a_prompt_that_fails_fails_the_batch_and_frees_the_others(pair, streamed):  # noqa: F811
    """The long prompt does not fit the tiny model's 512-token context with max_tokens 20 (found once its
    decoder is made, after the short ones started): the request is that prompt's 400, and every prompt's slot is
    freed."""
    r = replica(pair)
    batch = {"model": "m", "prompt": ["hi", "a" * 500, "hello"], "max_tokens": 20, "temperature": 0}

    async def scenario():
        with pytest.raises(api.APIError) as info:
            if streamed:
                [e async for e in r.generate_stream(batch)]
            else:
                await r.generate(batch)
        await r.runner.drain(10)
        return info.value, r.active

    err, active = asyncio.run(scenario())
    assert (err.status, err.code, err.param, active) == (400, "context_length_exceeded", "max_tokens", 0)
    assert err.message.startswith("prompt 1 of the batch of 50")  # 500 or 501 tokens (the tokenizer's BOS)


def test_a_batchs_bad_prompt_is_named_by_its_index(pair):  # noqa: F811
    r = replica(pair, max_prompt_tokens=8)
    with pytest.raises(api.APIError) as info:
        complete(r, prompt=["hi", "a much longer prompt"])
    assert info.value.status == 400 and "prompt 1 of the batch" in info.value.message
    with pytest.raises(api.APIError) as info:
        complete(r, prompt=[[5, 6], [5, 999]])
    assert info.value.status == 400 and "prompt 1 of the batch" in info.value.message


def test_one_prompt_in_an_array_answers_as_one_prompt(pair):  # noqa: F811
    r = replica(pair)
    one, listed = complete(r, prompt="hello", temperature=0), complete(r, prompt=["hello"], temperature=0)
    assert [c["text"] for c in listed["choices"]] == [c["text"] for c in one["choices"]]
    assert len(listed["choices"]) == 1


def test_n_choices_are_seeded_seed_plus_j_and_ordered_by_prompt(pair):  # noqa: F811
    """``n`` (refused before): choice j of a prompt is that prompt alone with seed + j (vLLM's rule; with one seed
    the n sampled choices were one text n times), a prompt's n choices before the next prompt's."""
    r = replica(pair)
    sampled = {"temperature": 0.8, "max_tokens": 8}
    alone = [complete(r, prompt=p, seed=7 + j, **sampled)["choices"][0]["text"] for p in PROMPTS[:2] for j in range(2)]
    out = complete(r, prompt=PROMPTS[:2], n=2, seed=7, **sampled)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == alone
    assert out["usage"]["prompt_tokens"] == sum(len(r.tokenizer.encode(p)) for p in PROMPTS[:2])  # once a prompt


def test_a_chat_with_n_streams_each_choices_role_and_text(pair):  # noqa: F811
    r = replica(pair)
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 1, "temperature": 0.8}
    whole = complete(r, **body)
    events = stream(r, **body)
    assert [e["choices"][0]["index"] for e in events[:3]] == [0, 1, 2]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in events[:3])
    texts = ["".join(e["choices"][0]["delta"].get("content", "") for e in events[3:] if e["choices"][0]["index"] == i)
             for i in range(3)]
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert len({c["message"]["content"] for c in whole["choices"]}) > 1  # seeds 1, 2, 3: not one text thrice


# ---- the helpers ------------------------------------------------------------------------------------------------
class Source:
    """An async stream of ``items`` (an Exception among them is raised there), recording whether it was closed
    before its end."""

    def __init__(self, items, gap_s: float = 0.0) -> None:
        self.items, self.gap_s, self.closed_early = items, gap_s, False

    async def __call__(self):
        done = False
        try:
            for item in self.items:
                await asyncio.sleep(self.gap_s)
                if isinstance(item, Exception):
                    raise item
                yield item
            done = True
        finally:
            self.closed_early = not done


def run_merged(sources, take: int | None = None) -> tuple[list, list[bool]]:
    """The items read (the first ``take``), and whether each source was closed early once the merged stream
    was closed (read at once, before any other task runs)."""
    async def go():
        out, stream = [], merged([s() for s in sources])
        try:
            async for item in stream:
                out.append(item)
                if take is not None and len(out) == take:
                    break
        finally:
            await stream.aclose()
        return out, [s.closed_early for s in sources]

    return asyncio.run(go())


def test_merged_tags_every_item_and_keeps_each_streams_order():
    fast, slow = Source("abc"), Source("xyz", gap_s=0.01)
    out, _ = run_merged([fast, slow])
    assert sorted(out) == sorted([(0, "a"), (0, "b"), (0, "c"), (1, "x"), (1, "y"), (1, "z")])
    assert [x for i, x in out if i == 0] == list("abc") and [x for i, x in out if i == 1] == list("xyz")


def test_merged_raises_a_failure_before_a_streams_first_item_before_yielding_anything():
    """A prompt refused before its first token (the context too long) must be the request's HTTP error: nothing
    may have been sent by then, though the other prompts already have tokens."""
    ok, refused = Source("abcdef"), Source([ValueError("too long")], gap_s=0.02)
    got = []

    async def go():
        async for item in merged([ok(), refused()]):
            got.append(item)

    with pytest.raises(ValueError, match="too long"):
        asyncio.run(go())
    assert got == [] and ok.closed_early is False  # (``ok`` had ended: 6 items in no time)


def test_a_failure_mid_stream_cancels_the_other_streams():
    """...and has them closed by the time the failure is raised (their slots freed before the error is sent)."""
    long, failing = Source(range(100), gap_s=0.01), Source(["a", RuntimeError("broke")], gap_s=0.02)

    async def go():
        with pytest.raises(RuntimeError, match="broke"):
            async for _ in merged([long(), failing()]):
                pass
        return long.closed_early  # read before anything else runs

    assert asyncio.run(go())


def test_closing_the_merged_stream_closes_every_stream():
    a, b = Source(range(100), gap_s=0.01), Source(range(100), gap_s=0.01)
    out, closed = run_merged([a, b], take=5)
    assert len(out) == 5 and closed == [True, True]


def test_all_or_none_returns_in_order_or_raises_the_first_failure_and_cancels_the_rest():
    async def value(x, delay):
        await asyncio.sleep(delay)
        return x

    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def fails():
        await asyncio.sleep(0.01)
        raise KeyError("gone")

    async def failing_batch():
        with pytest.raises(KeyError):
            await all_or_none([slow(), fails()])
        return list(cancelled)  # the slow one was cancelled before the failure was raised

    assert asyncio.run(all_or_none([value(1, 0.02), value(2, 0.0), value(3, 0.01)])) == [1, 2, 3]
    assert asyncio.run(failing_batch()) == [True]


def test_a_stream_cancelled_from_inside_ends_the_merge_instead_of_hanging_it():
    """A choice cancelled under the request (its wait on a shared set-up task cancelled as the replica stops)
    raises CancelledError, no Exception: the merge caught only Exceptions and waited for it forever."""
    async def cancelled_inside():
        yield "a"
        raise asyncio.CancelledError

    async def go():
        async def read():
            return [item async for item in merged([Source(range(3))(), cancelled_inside()])]

        try:
            await asyncio.wait_for(read(), 2.0)
        except asyncio.CancelledError:
            return "cancelled"
        except TimeoutError:
            return "hung"

    assert asyncio.run(go()) == "cancelled"


def test_all_or_none_ends_when_a_task_is_cancelled_from_elsewhere():
    """FIRST_EXCEPTION does not count a cancelled task: the batch waited for every other choice to end."""
    async def go():
        gate = asyncio.get_running_loop().create_future()

        async def waits():
            return await gate

        async def cancel_soon():
            await asyncio.sleep(0.01)
            gate.cancel()

        asyncio.ensure_future(cancel_soon())
        start = asyncio.get_running_loop().time()
        try:
            await all_or_none([waits(), asyncio.sleep(10)])
        except asyncio.CancelledError:
            return asyncio.get_running_loop().time() - start < 2

    assert asyncio.run(go()) is True


def test_a_freed_slot_goes_to_the_batchs_next_choice_not_to_a_request_arriving_then(pair):  # noqa: F811
    """max_concurrent 1, a batch of three prompts: when a choice ends, a request arriving at that moment is refused
    (429) and the batch's next choice runs. Before, waiting choices looked for a free slot every 50 ms, and single
    requests arriving in between took the freed slots — steady traffic could hold a batch's last choices back."""
    r = replica(pair, max_concurrent=1)
    release, arrivals = r.slots.release, []

    def released():
        release()
        arrivals.append(asyncio.ensure_future(r.generate({"model": "m", "prompt": "hello", "max_tokens": 2})))

    r.slots.release = released
    seen = peak_in_flight(r)

    async def scenario():
        batch = await r.generate({"model": "m", "prompt": PROMPTS, "max_tokens": 6, "temperature": 0})
        r.slots.release = release
        outcomes = []
        for arrival in arrivals:
            try:
                outcomes.append(len((await arrival)["choices"]))
            except api.APIError as refused:
                outcomes.append(refused.status)
        return len(batch["choices"]), outcomes[:2], seen[:3]

    assert asyncio.run(scenario()) == (3, [429, 429], [1, 1, 1])  # the third release frees the slot: no one waits
    assert r.active == 0


def _inline_prepare(r) -> None:
    """Prompts tokenised on the event loop: the order in which concurrent requests reach admission is then the
    order they were submitted in (the real ``_prepared`` is a thread, its wake-up order a race)."""
    async def prepared(req, chat):
        return r._prepare(req, chat)

    r._prepared = prepared


def test_batches_arriving_together_are_admitted_no_further_than_the_free_slots(pair):  # noqa: F811
    """max_concurrent 2, three batches of three prompts at once: the first is admitted (two choices run, one in
    line) and the others are 429s. The choices took their slots only when their tasks first ran, so all three
    batches were admitted (9 choices for 2 slots, 7 of them waiting)."""
    r = replica(pair, max_concurrent=2)
    _inline_prepare(r)

    async def scenario():
        body = {"model": "m", "prompt": PROMPTS, "max_tokens": 4, "temperature": 0}
        outcomes = await asyncio.gather(*(r.generate(body) for _ in range(3)), return_exceptions=True)
        return [len(o["choices"]) if isinstance(o, dict) else o.status for o in outcomes], outcomes[1].message, \
            r.active, r.slots.waiting

    said = "2 of max_concurrent 2 generation slots taken, 1 choice of batches waiting for one; retry later"
    assert asyncio.run(scenario()) == ([3, 429, 429], said, 0, 0)


def test_a_streamed_batch_is_not_held_back_by_a_request_that_arrives_as_it_starts(pair):  # noqa: F811
    """max_concurrent 3, one slot busy, a single request submitted just before a streamed batch of three: the
    batch's first two choices hold the free slots from its admission, and the single request is a 429. The stream
    counted the free slots at admission but its choices took them later, after the single request had taken one:
    it then held every event until its first choice had ended (all of choice 0's text before any of choice 1's)."""
    r = replica(pair, max_concurrent=3)
    _inline_prepare(r)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300, "ignore_eos": True}

    async def scenario():
        busy = r.generate_stream(chat)
        await busy.__anext__()
        single = asyncio.ensure_future(r.generate({"model": "m", "prompt": "hey", "max_tokens": 300,
                                                   "ignore_eos": True}))
        events = [e async for e in r.generate_stream({"model": "m", "prompt": PROMPTS, "max_tokens": 40,
                                                      "ignore_eos": True, "temperature": 0})]
        await busy.aclose()
        try:
            outcome = len((await single)["choices"])
        except api.APIError as refused:
            outcome = refused.status
        choices = [e["choices"][0] for e in events if e["choices"]]
        ends_0 = next(i for i, c in enumerate(choices) if c["index"] == 0 and c["finish_reason"])
        starts_1 = next(i for i, c in enumerate(choices) if c["index"] == 1)
        for _ in range(1000):  # the busy stream's inner generators are closed by their finalizers, a moment later
            await r.runner.drain(10)
            if r.active == 0:
                break
            await asyncio.sleep(0.01)
        return outcome, starts_1 < ends_0, r.active

    assert asyncio.run(scenario()) == (429, True, 0)


def test_a_streamed_batch_larger_than_its_slots_starts_before_its_waiting_choices_do(pair):  # noqa: F811
    """The stream held every event until every choice had started: a third choice waiting for one of the first
    two to end held their whole text back, the client seeing nothing until then."""
    r = replica(pair, max_concurrent=2)
    seen = peak_in_flight(r)

    async def scenario():
        events = r.generate_stream({"model": "m", "prompt": PROMPTS, "max_tokens": 40, "ignore_eos": True,
                                    "temperature": 0})
        await events.__anext__()
        at_first_event = len(seen)
        rest = [e async for e in events]
        return at_first_event, len(seen), sorted(e["choices"][0]["index"] for e in rest if e["choices"]
                                                 and e["choices"][0]["finish_reason"])

    assert asyncio.run(scenario()) == (2, 3, [0, 1, 2])


def test_merged_holds_only_for_the_streams_it_is_told_to():
    early, late = Source("ab"), Source("xy", gap_s=0.05)

    async def go():
        stream = merged([early(), late()], hold=1)
        first = await stream.__anext__()
        rest = [item async for item in stream]
        return first, rest

    first, rest = asyncio.run(go())
    assert first == (0, "a") and rest == [(0, "b"), (1, "x"), (1, "y")]
