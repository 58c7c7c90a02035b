"""The ingress's metrics say what happened: tokens counted as they go out (a client gone mid-stream included), the
time to first token from the request's arrival to the first text the client gets, acceptance over the steps that
verified a tree, and the speculating gauge following a bucket whose plan became the target alone. No Ray: the
ingress driven as Serve drives it (``tests/disconnects``), its metrics recorded."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from deployments.ingress import OpenAIIngress
from deployments.metrics import ServiceMetrics
from deployments.service import ActivePlan, Runner
from deployments.slots import Slots
from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import ROOT_ONLY, Chunk, Stats
from sequoia_ray.in_flight import InFlight
from sequoia_ray.live_cost import CostSettings, StepRates
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan import chain
from sequoia_ray.verify import Verdict
from tests.disconnects import SlowDecoder, drive
from tests.recorders import Recorder as _Recorder


class _Replica(OpenAIIngress.func_or_class):
    def __del__(self) -> None:  # no background loops to stop
        pass


def replica(decoder, prepare_s: float = 0.0) -> _Replica:
    r = object.__new__(_Replica)
    r.cfg = SimpleNamespace(max_concurrent=4, model_name="m")
    r.in_flight, r.runner, r.background = InFlight(0.0), Runner(4), []
    r.slots = Slots(r.in_flight, 4)
    r.metrics = ServiceMetrics()
    for name, value in list(vars(r.metrics).items()):
        if hasattr(value, "observe") or hasattr(value, "inc") or hasattr(value, "set"):
            setattr(r.metrics, name, _Recorder())
    r.families = r.rules = r.live = None
    plans = SimpleNamespace(hardware="hw", get=lambda t, size=1: ActivePlan(builtin_plan(t), "builtin"))

    async def get_plans():
        return plans

    async def get_decoder(*args, **kwargs):
        return decoder

    async def prepared(req, chat):
        await asyncio.sleep(prepare_s)  # rendering and tokenising the prompt
        return [[1, 2, 3]], SamplingParams(max_tokens=11)

    r._plans, r._decoder, r._prepared = get_plans, get_decoder, prepared
    return r


REQUEST = SimpleNamespace(stream=True, id_kind="cmpl", speculative=True, usage_every_chunk=False, usage_chunk=False,
                          choices=1, prompt_param="prompt",
                          logprob_count=None)


def test_a_client_gone_mid_stream_has_its_tokens_and_first_token_counted():
    """Tokens and the time to first token were recorded from the finish chunk's stats only: a client that left
    mid-stream (or a target that failed after N tokens) counted no tokens and no first token, so the counter
    undercounted and the TTFT histogram lost the slow requests whose clients gave up."""
    decoder = SlowDecoder(0.1, first_s=0.01, chunk=lambda i: Chunk([5, 6], "ab"))  # never finishes by itself

    async def run():
        r = replica(decoder)
        response = await r._serve(REQUEST, chat=False, ended=r._counter("completions"), received=time.perf_counter())
        await drive(response, disconnect_after=0.55)
        del response
        gc.collect()
        await asyncio.wait_for(asyncio.to_thread(decoder.freed.wait, 10), 15)
        await asyncio.sleep(0.2)
        return r.metrics

    metrics = asyncio.run(run())
    produced = sum(value for value, _ in metrics.tokens.calls)
    assert produced >= 2 * 3 and produced % 2 == 0, metrics.tokens.calls  # ~5 chunks of 2 ids went out
    assert len(metrics.ttft.calls) == 1 and metrics.ttft.calls[0] < 0.5
    assert [tags["status"] for _, tags in metrics.requests.calls] == ["499"]


def test_the_first_token_is_the_first_text_the_client_gets_counted_from_arrival():
    """TTFT was taken at the first chunk with ids, though a chunk whose text is held back (part of a stop string
    or of a character) sends the client nothing, and its clock started after the prompt was prepared."""
    def chunk(i):
        if i == 0:
            return Chunk([5], "")  # held back
        if i < 3:
            return Chunk([6], "x")
        return Chunk([7], "y", "length", Stats(steps=4, tokens=4))

    class Finite(SlowDecoder):
        def _steps(self):
            for i in range(4):
                time.sleep(0.01 if i == 0 else 0.3)
                yield chunk(i)

    async def run():
        r = replica(Finite(), prepare_s=0.2)
        arrived = time.perf_counter()
        response = await r._serve(REQUEST, chat=False, ended=r._counter("completions"), received=arrived)
        await drive(response, disconnect_after=30)
        return r.metrics, time.perf_counter() - arrived

    metrics, whole = asyncio.run(run())
    [ttft] = metrics.ttft.calls
    assert 0.2 + 0.01 + 0.3 <= ttft < whole  # preparation, the held-back chunk, then the first text
    assert sum(value for value, _ in metrics.tokens.calls) == 4
    assert [tags["status"] for _, tags in metrics.requests.calls] == ["200"]


def test_acceptance_is_counted_over_the_steps_that_verified_a_tree():
    """A held gauge of the last request's accepted / steps counted every step that ran the target alone (the
    first step, live-cost probes, a root-only plan, the last token) as a rejection: a perfect draft read 0.75,
    and 0 while the live cost served the target alone. Now two counters over tree steps, and the draft's time
    per tree step."""
    metrics = ServiceMetrics()
    for name in ("tree_steps", "accepted_steps", "draft_step", "verify_step", "tokens_per_step", "tree_nodes"):
        setattr(metrics, name, _Recorder())
    stats = Stats(steps=6, tokens=14, accepted_hist=Counter({0: 3, 4: 3}), root_rank_hist=Counter({1: 3, 0: 1}),
                  draft_s=0.4, verify_s=0.6, tree_nodes=30)  # 4 tree steps (one accepted nothing), 2 alone
    metrics.finished(stats)
    assert metrics.tree_steps.calls == [(4, None)] and metrics.accepted_steps.calls == [(3, None)]
    assert metrics.draft_step.calls == [pytest.approx(0.1)] and metrics.verify_step.calls == [pytest.approx(0.1)]
    alone = ServiceMetrics()
    for name in ("tree_steps", "accepted_steps", "draft_step", "verify_step", "tokens_per_step", "tree_nodes"):
        setattr(alone, name, _Recorder())
    alone.finished(Stats(steps=5, tokens=5, accepted_hist=Counter({0: 5}), verify_s=0.5, tree_nodes=5))
    assert alone.tree_steps.calls == alone.accepted_steps.calls == alone.draft_step.calls == []


def test_a_bucket_whose_plan_became_the_target_alone_is_not_shown_speculating():
    """Once a bucket's plan was root-only (a live re-plan, the store's), its steps never reached the live cost,
    and ``sequoia_speculating`` went on reading 1 (the last phase's tree) for as long as the replica lived."""
    clock = [0.0]
    rates = StepRates(CostSettings(probe_every=100, probe_rounds=1, window=8, min_steps=1), clock=lambda: clock[0])
    arm = rates.policy(SamplingParams(temperature=0.0, max_tokens=100))

    def steps(base, count):
        for _ in range(count):
            plan = arm.plan(base)
            clock[0] += 0.1
            arm.observe(plan, Verdict(list(range(plan.num_levels)), [7] * plan.num_levels), 0.1)

    steps(chain(4), 30)  # 4 tokens a step against 1: the tree serves
    assert rates.summary()["all-b1"]["serving"] == "tree"
    steps(ROOT_ONLY, 20)
    metrics = ServiceMetrics()
    metrics.speculating, metrics.step_rate = _Recorder(), _Recorder()
    metrics.step_rates(rates.summary())
    assert metrics.speculating.calls == [(0.0, {"temperature": "all", "batch": "1"})]
    steps(chain(4), 1)  # a tree plan again: the live cost's arm shows again
    assert rates.summary()["all-b1"]["serving"] == "tree"


@pytest.mark.parametrize("order", ["greedy first", "sampled first", "alternating"])
def test_greedy_requests_beside_sampled_ones_planned_alone_still_show_the_tree(order):
    """The live cost's key pools every temperature. A batch of 8: 4 greedy requests on a tree plan and 4 sampled
    ones whose bucket plan is root-only. The summary said "alone" (and ``sequoia_speculating`` 0) whenever a
    sampled request stepped last, though the tree served every greedy step (session 60's sweep: 256 tree steps).
    Once only root-only plans run for two rounds it says the target alone."""
    clock = [0.0]
    rates = StepRates(CostSettings(probe_every=100, probe_rounds=1, window=8, min_steps=1), clock=lambda: clock[0])
    arms = {i: rates.policy(SamplingParams(temperature=0.0 if i < 4 else 0.6, max_tokens=100), batch=lambda: 8)
            for i in range(8)}
    sequence = {"greedy first": list(range(8)), "sampled first": [4, 5, 6, 7, 0, 1, 2, 3],
                "alternating": [0, 4, 1, 5, 2, 6, 3, 7]}[order]
    for round_ in range(20):
        for i in sequence if round_ % 2 == 0 else sequence[::-1]:  # the order may change between rounds
            plan = arms[i].plan(chain(4) if i < 4 else ROOT_ONLY)
            clock[0] += 0.1
            arms[i].observe(plan, Verdict(list(range(plan.num_levels)), [7] * plan.num_levels), 0.1)
        assert rates.summary()["all-b8"]["serving"] == "tree", round_
    for _ in range(2 * 8):  # the greedy requests ended: two rounds of root-only plans
        plan = arms[4].plan(ROOT_ONLY)
        arms[4].observe(plan, Verdict([0], [7]), 0.1)
    assert rates.summary()["all-b8"]["serving"] == "alone"
