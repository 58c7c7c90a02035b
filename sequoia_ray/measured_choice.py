"""The measured choice: the cost model ranks the trees, real steps decide among the best few.

``choose`` predicts every (n, d); the few it predicts fastest (distinct trees) and the root-only tree (the
target alone, the baseline every speedup is over, and itself a candidate: a batch where speculation does not
pay serves it) are run for real in lockstep at the batch size (``sequoia_ray.lockstep``), round-robin over
``rounds`` rounds — round r decodes prompts r·B, r·B + 1, ... with seed r for every candidate, so they do the
same work and load drift hits them alike. The measured throughput is the timed steps' tokens a request-step times
their request-steps a second (the first step, which prefills, is not timed; the tail of a run, once a request has
finished, gives its tokens but not its seconds: serving fills the batch again, ``_Runs.tokens_per_s``) — plus,
for plans that will be served, the actor calls every
request makes each step (``calls``, from ``actors.call_probe``; lockstep runs make none: a root-only step's one
call, a tree step's two and the tree between them), as the cost model adds them. The pick is the fastest
measured, the prediction only the prior that chose who gets measured.

Without the calls a check measures steps Serve does not run: on the 2-core EPYC the bucket-8 tree (n = 2, d = 2)
measured 1.01-1.03x the target alone in process (session 36) and ran at 0.78x it through Serve. Its calls, 4.24
ms a request for a tree step against 1.55 ms for a root-only one, take ~4% off its measured speedup there (0.96x
in process, 0.92x charged, from the same runs; session 37).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DraftWorker
from sequoia_ray.hardware import Choice, timed_rounds
from sequoia_ray.lockstep import LockstepRun, run_lockstep
from sequoia_ray.target import TargetWorker
from sequoia_ray.tree.plan import TreePlan


@dataclass(frozen=True)
class Measured:
    choice: Choice
    measured_speedup: float  # tokens/s over the root-only tree's at the same batch size
    tokens_per_s: float
    tokens_per_step: float  # per request and step

    def to_dict(self) -> dict:
        c = self.choice
        return {"n": c.n, "d": c.d, "predicted_speedup": round(c.predicted_speedup, 4),
                "measured_speedup": round(self.measured_speedup, 4), "tokens_per_s": round(self.tokens_per_s, 3),
                "tokens_per_step": round(self.tokens_per_step, 3)}


def top_candidates(candidates: list[Choice], k: int) -> list[Choice]:
    """The root-only choice, then the ``k`` distinct trees (by shape) predicted fastest."""
    ranked = sorted(candidates, key=lambda c: (-round(c.predicted_speedup, 12), c.n, c.d))
    root = next(c for c in candidates if c.n == 1)
    picked, shapes = [root], {root.plan.parents}
    for c in ranked:
        if len(picked) > k:
            break
        if c.plan.parents not in shapes:
            picked.append(c)
            shapes.add(c.plan.parents)
    return picked


def measure_choices(target_model, draft_model, choices: list[Choice], prompts: list[list[int]],
                    params: SamplingParams, *, batch: int, rounds: int,
                    calls: tuple[float, float] = (0.0, 0.0)) -> list[Measured]:
    """Each of ``choices`` (the first must be the root-only tree: the baseline) run for real, ``rounds``
    rounds round-robin; in the order given. ``calls``: (root-only, tree) seconds of a request's actor calls a
    served step makes, added to every timed step per request (0: measured as in process)."""
    if not choices or choices[0].n != 1:
        raise ValueError("the first choice must be the root-only tree (the baseline speedups are measured over)")
    if len(calls) != 2 or not all(math.isfinite(c) and c >= 0 for c in calls):
        raise ValueError(f"calls {calls!r}: give (root-only, tree) seconds a request's step spends in actor calls, "
                         "each finite and >= 0")
    work = [[prompts[(r * batch + i) % len(prompts)] for i in range(batch)] for r in range(rounds)]
    runs = {i: _Runs(target_model, draft_model, c.plan, work, params, calls[int(c.n > 1)])
            for i, c in enumerate(choices)}
    timed_rounds({i: run.next for i, run in runs.items()}, repeats=rounds, warmup=0)
    base = runs[0].tokens_per_s
    return [Measured(c, runs[i].tokens_per_s / base, runs[i].tokens_per_s, runs[i].tokens_per_step)
            for i, c in enumerate(choices)]


def pick(measured: list[Measured]) -> Measured:
    """The fastest measured (the smaller tree on a tie), among those with a rate: a run with no timed step that
    held the whole batch (its requests ended at once) has none (NaN), and ``max`` kept a NaN met first."""
    timed = [m for m in measured if math.isfinite(m.tokens_per_s)]
    if not timed:
        raise ValueError(f"none of {len(measured)} measured trees had a timed step with its whole batch (every "
                         "run's requests ended at once); give more tokens per request (measure_tokens)")
    return max(timed, key=lambda m: (m.tokens_per_s, -m.choice.n, -m.choice.d))


class _Runs:
    """One candidate's runs, one round per call (``timed_rounds`` calls them in turn)."""

    def __init__(self, target_model, draft_model, plan: TreePlan, work: list[list[list[int]]],
                 params: SamplingParams, call_s: float = 0.0) -> None:
        self.run = functools.partial(run_lockstep, plan=plan, params=params)
        self.target_model, self.draft_model, self.work = target_model, draft_model, work
        self.call_s = call_s  # seconds of actor calls a request makes each step when served
        self.done: list[LockstepRun] = []

    def next(self) -> float:
        r = len(self.done)
        self.done.append(self.run(TargetWorker(self.target_model), DraftWorker(self.draft_model), self.work[r], seed=r))
        return self.done[-1].seconds

    @property
    def tokens_per_s(self) -> float:
        """Serving's rate at the batch measured: request-steps a second, from the timed steps that held the whole
        batch (each charged ``call_s`` for each request in it), times tokens a request-step, over every timed step.
        A run's tail, where the requests that finished first have left, runs the others at a smaller batch than
        the one measured, while serving refills the batch: its seconds are left out. Its tokens are not: the
        requests still running there are the slow ones (prose beside code), and serving spends a slot's steps on
        them for as long. Read off the whole-batch steps alone, a tree's rate weighed fast and slow requests alike
        until the first finished: a review's code/prose batch of 2 read 7.6% above the same mix served with
        refill (the target alone's requests finish together: unbiased either way)."""
        rates = [run.full_rate() for run in self.done]
        seconds = sum(s + self.call_s * steps for _, s, steps in rates)
        request_steps = sum(sum(run.batch) for run in self.done)
        if seconds <= 0 or request_steps == 0:
            return math.nan
        per_request_step = sum(run.timed_tokens for run in self.done) / request_steps
        return per_request_step * sum(steps for _, _, steps in rates) / seconds

    @property
    def tokens_per_step(self) -> float:
        return sum(run.tokens_per_step for run in self.done) / len(self.done)
