"""Which pays at the batch size running now, the tree or the target alone: measured on live steps.

The cost model (``hardware.choose``) predicts a step's time from the forwards it profiled and the overhead it
measured in process. Serving adds costs no in-process profile sees: the Serve proxy, the ingress's event loop,
actor calls under contention from every other request. Measured on a 2-core CPU with the real pair, the
overhead-aware plan for 8 clients (n = 2, d = 2) ran at 0.77x the target alone. No prediction alone can
promise that speculating is never slower than not, so the service measures both.

Per key (the batch bucket: requests of every temperature together), steps run in *phases*. A batch's requests
step in lockstep whatever their temperatures, so one arm serves them all: keyed by temperature too, a mix of
greedy and sampled requests ran both arms in one batch whenever the two keys had chosen differently, each
key's steps always beside the other's other arm, so neither measured again (a review's simulation: 2,906 of
3,000 rounds split, and a tree grown 2x faster never served). Its rate is measured on every temperature's
requests together, as they share the batch. A served phase runs the arm that measured
faster (at first: the tree) for ``probe_every`` rounds. A probe phase then runs the other arm for
``probe_rounds`` rounds, and the next served phase runs whichever is now faster. A round is as many steps as
there are requests in flight, so every request steps about once per round. A phase changes only between two
rounds (a round ends when a request of it begins its next step, or when as many requests as are in flight
began one), so every request of a round runs the same arm: a switch that reached the requests one step apart
split the lockstep batch, half of it drafting while the other half waited (see below). The first ``settle_rounds``
rounds of a phase are not measured (``CostSettings.settle_rounds``: 1 by default, 2 in the service): a draft
catching up on tokens it missed is slow once, and at a batch for more than one round. Traced through Serve at
8 clients (session 38): a switch to the tree splits the drafts' catch-up into two or three forwards (the
requests reach the draft one alone step apart: 2, 4 and 1 requests, 144-456 ms), the target's lockstep waits up
to 0.76 s for them, and the second round still carried 341 tokens of catch-up; the tree's steady rounds took
~0.32 s. With one round unmeasured the probes measured the tree at 0.49-0.70x the target alone's rate a request,
where the tree served at every step gave 1.006x its throughput. Nor is a step that overlapped another
request's step of the other arm (a phase's switch reaches the requests one step apart, and a target-alone step
beside a tree step shares its forwards and cores): each arm is measured beside its own kind only.

The measure is a request's tokens per second of its whole step cycle (``seconds`` from the engine: from the
previous verdict to this one, so Serve's costs are in), summed over an arm's measured steps in its last
``phases`` phases (older ones too while that makes fewer than ``min_steps``), at most ``window`` of them
(tokens / seconds of the sums, not a mean of ratios): a probe is judged on its own steps and the previous
probe's, not on probes from long ago. A request's first step (its prefill) is not
measured, nor a step during which the target forwarded another request's prompt (``Verdict.prefill_beside``:
in its forward or in one its call queued behind): a prefill chunk costs several decode forwards and lands
on whichever arm runs then. Seen through Serve at 8 clients, a request starting about every second: the
target alone's steps in one phase measured 2.2 tokens/s a request against 5.0 before, and the tree served
the cell at 0.79x the target alone's throughput. A prompt the draft prefills beside tree steps is not seen
(the tree arm may look slower than it is).

Probes back off: a served phase after a probe that confirmed its arm lasts twice as long as the one before, up to
``backoff`` x ``probe_every`` rounds, and at once that long when the probed arm ran below ``wide`` x the served
arm's rate (a loss that wide takes a large change of host or traffic to turn; probing it again soon costs more
than it can find: at 8 clients through Serve the tree ran at 0.62x the target alone's rate a request, and each of
its probes first catches up every request's draft and splits the batch, session 18); a probe whose arm wins, or a
served phase that ends early, brings it back to ``probe_every``. The cost of probing: at most ``(s +
probe_rounds) / (probe_every + s + probe_rounds)`` of the steps, s = ``settle_rounds`` (3.8% with the defaults,
4.8% with the service's s = 2) run the slower arm, falling to ``(s + probe_rounds) / (backoff x probe_every + s +
probe_rounds)`` (0.5%, 0.6%) while the served arm stays the faster one. Each tree probe costs more than its
steps: every request's draft first catches up on all it missed since its last tree (measured through Serve at
4 clients, session 15: 60 tree steps begun in 1336, 26 of them measured).

What a request costs beyond its steps is counted too. Its first step (its prompt's prefill) and the steps beside
a prefill are not samples, but their excess over the arm's rate is kept per arm, and once both arms have some,
an arm's rate r becomes L / (L / r + X), L the tokens a request generates here (the mean of the last
``LENGTHS`` requests that ended) and X the excess per request admitted (see ``StepRates._admission``). The tree's is the larger
(the draft prefills too, and a joining request waits for longer steps). While one arm's first steps are
measured and the other's are not, the first one's served phases last ``probe_every // FIRST_STEP_PROBES`` rounds,
so the other arm is probed sooner, up to ``FIRST_STEP_PROBES`` times (requests so long that none begins in that
many probes make first steps a small cost anyway). Those probes are spaced, not back to back: a service's first
request, which nothing begins beside, ran 32 of its first 40 steps with the target alone when they were (the main
job's demo through Serve: 2.0 against 4.8 tokens/step with the tree, session 18).

A served phase ends early when, after a probe's worth of its own measured steps, its arm's rate has fallen below
the other arm's by more than ``LOSING_Z`` standard errors of the difference: the other arm is probed again at
once, and the faster then serves. A probe's few steps can mislead (seen through Serve at 2 clients: the tree
chosen on 6 steps, then 117 steps at 0.77x the target alone's rate).

A served phase also ends, for a probe, once the other arm last ran ``max_age_s`` ago: the two rates are
compared at about the same host speed and traffic. Without it a backed-off phase at 8 clients
(a round ~2 s) runs 800 rounds, and the served arm's fresh rate was compared with the other's from the first
minute: through Serve at 8 clients (session 24) the target alone's rate inside the tree's run was measured
once, in the first minute (1.9-2.4 tokens/s a request, 15-24 steps), never again within the 3 minutes, while
the target alone served by itself gave 2.0-3.1; on this host the speed moves up to 2x within minutes. Only the
served arm's falling rate ended a phase early, never the other arm's rising one. The cost: at most one probe
(``settle_rounds + probe_rounds`` rounds of the other arm) per ``max_age_s``, about 4% of the rounds at 8
clients with the defaults (a round ~2 s), ~1% at 1 client (~0.4 s); below that age the backoff spaces them.
The age runs from the other arm's last step begun (its probe's end), not from its newest measured step: a
probe whose steps all go unmeasured (beside prefills, beside the other arm, settling) would leave that age
as it was, and every served phase after it ended for another probe once its settle rounds were done (at 1
request, the tree at 4 tokens/s and every target-alone step beside a prefill, the slower arm ran 78% of the
steps). A rate its probes cannot measure stays the one measured last; it is probed again after ``max_age_s``.

A new key's first phase is the tree's, unless the nearest smaller batch bucket of its temperature whose two
arms are measured found the target alone faster. Speculation pays less as the batch grows (the target's forward
gets cheaper per token, the draft's levels and the per-request costs do not), so the larger batch then serves
the target alone first and probes the tree after ``probe_every`` rounds, instead of learning what the smaller
batch already showed at the price of a tree phase.

The target alone is a root-only tree, verified like any other: choosing it never touches exactness.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import mean

from sequoia_ray.config import SamplingParams
from sequoia_ray.engine import ROOT_ONLY, StepPolicy
from sequoia_ray.hardware import batch_bucket
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.verify import Verdict

TREE, ALONE = "tree", "alone"
ARMS = (TREE, ALONE)
POOLED = "all"  # the temperature part of every served key: one arm per batch bucket (see the module docstring)
LENGTHS = 256  # the requests that ended whose mean length is L (the latest: a sum since the start never forgot
# a burst of short requests; 3,000 of them, then 300 of 40 tokens, still read 9.4)
COST_EVENTS = 8  # a key's admission events kept per arm: this many times ``window`` (first steps and the steps
# beside them: up to 2 x the batch per request admitted)
FIRST_STEP_PROBES = 8  # probes a key runs for an arm with no request's first step seen (then goes on without)
# while one arm lacks first steps, served phases last probe_every // FIRST_STEP_PROBES rounds (so its probes
# come sooner, spaced)


LOSING_Z = 2.0  # standard errors a served arm's rate must fall below the other's to end its phase early (``_losing``)


def _other(arm: str) -> str:
    return ALONE if arm == TREE else TREE


@dataclass(frozen=True)
class CostSettings:
    probe_every: int = 100  # rounds of the faster arm between two probes of the other one
    probe_rounds: int = 3  # measured rounds of a probe (``settle_rounds`` more, not measured, come first)
    settle_rounds: int = 1  # a phase's first rounds, not measured: the switch settles (the service: 2; see the
    # module docstring)
    window: int = 256  # measured steps kept per arm and key (the most recent)
    min_steps: int = 3  # measured steps an arm needs before its rate counts
    backoff: int = 8  # confirmed served phases grow twice as long each time, up to this many probe_every
    wide: float = 0.7  # a probed arm slower than this fraction of the served arm's rate: back off fully at once
    phases: int = 2  # an arm's rate: its measured steps of its last this many phases (min_steps at least)
    stale_s: float = 150.0  # a step not ended after this long (its request failed mid-step; a step lasts at most
    # two calls of step_timeout_s) no longer marks the steps beside it
    max_age_s: float = 180.0  # a served phase ends for a probe once the other arm last ran this long ago
    # (seconds; 0: never, only phase lengths and the backoff space the probes)

    def __post_init__(self) -> None:
        for name in ("probe_every", "probe_rounds", "settle_rounds", "window", "min_steps", "backoff", "phases"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        if self.stale_s <= 0:
            raise ValueError(f"stale_s {self.stale_s} must be > 0 (seconds)")
        if self.max_age_s < 0:
            raise ValueError(f"max_age_s {self.max_age_s} must be >= 0 (seconds; 0: rates never age)")
        if not 0 <= self.wide <= 1:
            raise ValueError(f"wide {self.wide} must be in [0, 1] (a fraction of the served arm's rate; 0: never)")


@dataclass
class _Key:
    """One key's state: the phase running and the measured steps per arm."""

    key: tuple[str, int] = ("", 1)
    arm: str = TREE
    probing: bool = True  # the first phase measures the tree, the second the target alone
    phase: int = 0  # phase id: a step's sample counts only if its phase is still running when it ends
    steps: int = 0  # steps begun in this phase
    length: int = 0  # steps this phase lasts
    settle: int = 0  # its first steps, not measured
    recorded: int = 0  # measured steps recorded in this phase
    served: str | None = None  # the arm of the last served phase (None: none yet)
    spacing: int = 1  # the next served phase lasts spacing x probe_every rounds (the backoff)
    samples: dict[str, deque] = field(default_factory=dict)  # arm -> deque[(tokens, seconds, phase id)]
    admits: dict[str, deque] = field(default_factory=dict)  # arm -> deque[seconds]: requests' first steps
    costs: dict[str, deque] = field(default_factory=dict)  # arm -> deque[(excess, tokens, seconds, first)]:
    # measured first steps and steps beside a prefill (``StepRates._admission``); excess over the arm's step rate
    # when it was recorded (None: not measured yet then)
    first_probes: int = 0  # probes run for an arm with no first step measured yet
    begun: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ARMS, 0))  # arm -> steps run, all
    round: set = field(default_factory=set)  # requests that began a step in the current round (see ``begin``)
    seen: dict[str, float] = field(default_factory=dict)  # arm -> clock time of its newest measured step
    ran: dict[str, float] = field(default_factory=dict)  # arm -> clock time its newest step began (``_aged``)
    planned_alone: int = 0  # steps whose plan was root-only (the planner's choice: no arm to choose) since the
    # key's last step with a tree plan; ``summary`` says the target alone serves after two rounds of them
    planned_batch: int = 1  # the batch of the latest of them

    def rate(self, arm: str, min_steps: int, phases: int) -> float | None:
        """Tokens/s of ``arm``'s measured steps in its last ``phases`` phases, and older ones while they are
        fewer than ``min_steps`` (None: fewer than ``min_steps`` in all)."""
        return self.rate_error(arm, min_steps, phases)[0]

    def rate_error(self, arm: str, min_steps: int, phases: int) -> tuple[float | None, float]:
        """(``rate``, its standard error): a ratio of sums, its variance by the delta method,
        sum((t_i - R s_i)^2) / (sum s_i)^2 x n / (n - 1) (0 with one step)."""
        got, kept = [], []
        for tokens, seconds, phase in reversed(self.samples.get(arm, ())):
            if phase not in kept:
                if len(kept) >= phases and len(got) >= min_steps:
                    break
                kept.append(phase)
            got.append((tokens, seconds))
        seconds = sum(s for _, s in got)
        if len(got) < min_steps or seconds <= 0:
            return None, 0.0
        rate = sum(t for t, _ in got) / seconds
        n = len(got)
        spread = math.fsum((t - rate * s) ** 2 for t, s in got) * n / (n - 1) if n > 1 else 0.0
        return rate, math.sqrt(spread) / seconds


@dataclass
class Step:
    """One request's step under ``StepRates``: its key, arm and phase, and whether it counts."""

    key: tuple[str, int]
    arm: str
    phase: int
    measured: bool  # not a phase's settling step
    request: object  # who steps (any hashable: one step in flight per request)
    began: float  # StepRates.clock()
    alike: bool = True  # no step of the other arm ran beside it (so far)


class StepRates:
    """The arm to serve per (temperature bucket, batch bucket), from live steps (see the module docstring).
    Thread-safe: every request thread calls ``begin`` and ``record``. ``clock``: seconds, monotonic (tests pass
    a fake one)."""

    def __init__(self, settings: CostSettings = CostSettings(), clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self._keys: dict[tuple[str, int], _Key] = {}
        self._running: dict[object, Step] = {}  # request -> its step in flight
        self._finished: dict[str, deque] = {}  # temperature part of a key -> the tokens of the latest requests
        # that ended there
        self._lock = threading.Lock()

    def begin(self, key: tuple[str, int], batch: int, request: object) -> Step:
        """``request``'s step begins under ``key`` with ``batch`` requests in flight: its arm, and whether it is
        to be measured. End it with ``record`` (or ``end``)."""
        with self._lock:
            now = self.clock()
            state = self._keys.get(key)
            if state is None:
                state = self._keys[key] = _Key(key)
                if self._alone_below(key):  # serve the target alone first; the tree's probe comes later
                    state.arm, state.probing = ALONE, False
                self._start(state, batch)
            if request in state.round or len(state.round) >= batch:  # a new round: the phase may change
                state.round.clear()
                if state.steps >= state.length:
                    self._next(state, batch)
                elif self._losing(state, batch):  # probe the other arm now: decide on fresh steps of both
                    state.arm, state.probing, state.spacing = _other(state.arm), True, 1
                    self._start(state, batch)
                elif self._aged(state, now):  # the other arm's rate is old: probe it again (the backoff stays)
                    state.arm, state.probing = _other(state.arm), True
                    self._start(state, batch)
            state.planned_alone = 0
            state.round.add(request)
            state.steps += 1
            state.begun[state.arm] += 1
            state.ran[state.arm] = now
            step = Step(key, state.arm, state.phase, state.steps > state.settle, request, now)
            self._overlap(step)
            return step

    def planned_alone(self, key: tuple[str, int], batch: int = 1) -> None:
        """A step of ``key`` whose plan is the target alone (a live re-plan or the store's, measured faster), with
        ``batch`` requests in flight: no arm to choose or measure. ``summary`` says the target alone serves once
        two rounds of such steps (``2 x batch``) ran with no tree plan's step between them, until a tree step
        begins there again (it went on saying the tree, as its last phase did). Not at the first: the key pools
        every temperature, and a batch of greedy requests beside sampled ones whose plan is root-only flipped
        it at every step (session 60's mixed-temperature sweep read "alone" beside 256 tree steps)."""
        with self._lock:
            if (state := self._keys.get(key)) is not None:
                state.planned_alone += 1
                state.planned_batch = max(1, batch)

    def record(self, step: Step, tokens: int, seconds: float, *, first: bool = False, counted: bool = True,
               beside: bool = False) -> None:
        """A step ends with its tokens and cycle seconds. ``first``: its request's first step (its prefill);
        ``beside``: the target forwarded another request's prompt beside it. Both measure the arm's admission
        cost (see ``_admission``). Otherwise measured if it was to be, ``counted`` (not cut short), overlapped
        no step of the other arm, and its phase still runs."""
        with self._lock:
            self._end(step)
            state = self._keys.get(step.key)
            if state is None or seconds <= 0:
                return
            if first:
                state.admits.setdefault(step.arm, deque(maxlen=self.settings.window)).append(seconds)
            if not counted or not step.measured or not step.alike:
                return
            if first or beside:  # not a phase's settling step (a switch catches every draft up), nor beside the
                # other arm: what admitting a request costs this arm's requests
                rate = state.rate(step.arm, self.settings.min_steps, self.settings.phases)
                state.costs.setdefault(step.arm, deque(maxlen=COST_EVENTS * self.settings.window)).append(
                    (None if rate is None else seconds - tokens / rate, tokens, seconds, first))
                return
            if state.phase != step.phase:
                return
            state.samples.setdefault(step.arm, deque(maxlen=self.settings.window)).append(
                (tokens, seconds, step.phase))
            state.seen[step.arm] = self.clock()
            state.recorded += 1

    def end(self, step: Step) -> None:
        """A step ends without a verdict (its request failed): it no longer marks the steps beside it."""
        with self._lock:
            self._end(step)

    def finished(self, temperature: str, tokens: int) -> None:
        """A request of ``temperature``'s bucket ended with ``tokens`` tokens: what a request generates here."""
        with self._lock:
            self._finished.setdefault(temperature, deque(maxlen=LENGTHS)).append(tokens)

    def _overlap(self, step: Step) -> None:
        """Mark ``step`` and the steps running beside it of the other arm as not alike (not measured)."""
        stale = step.began - self.settings.stale_s  # a step never ended (its request failed): forget it
        self._running = {r: s for r, s in self._running.items() if s.began > stale and r is not step.request}
        for other in self._running.values():
            if other.arm != step.arm:
                other.alike = step.alike = False
        self._running[step.request] = step

    def _end(self, step: Step) -> None:
        if self._running.get(step.request) is step:
            del self._running[step.request]

    def _rate(self, state: _Key, arm: str, min_steps: int | None = None) -> float | None:
        """``arm``'s tokens/s a request, its admission cost included (see ``_admission``)."""
        return self._rate_error(state, arm, min_steps)[0]

    def _rate_error(self, state: _Key, arm: str, min_steps: int | None = None) -> tuple[float | None, float]:
        """(``_rate``, its standard error): the steps' (``_Key.rate_error``) carried through the admission
        cost, f(r) = L / (L / r + X), f'(r) = (f / r)^2."""
        rate, error = state.rate_error(arm, self.settings.min_steps if min_steps is None else min_steps,
                                       self.settings.phases)
        tokens = self._request_tokens(state)
        if rate is None or tokens is None:
            return rate, error
        charged = tokens / (tokens / rate + self._admission(state, arm, rate))
        return charged, error * (charged / rate) ** 2

    def _admission(self, state: _Key, arm: str, rate: float) -> float:
        """Seconds an admitted request costs ``arm``'s requests beyond their steps at ``rate`` (tokens/s a request).

        A request's first step prefills its prompt, and the steps of the batch's other requests beside it wait
        longer (the target's forward holds the prompt; under the tree the next draft forward catches its draft
        up too). Their excess over ``rate`` (seconds - tokens / rate), summed over an arm's first steps and the
        steps beside them and divided by its first steps, is what each admission costs; every request is
        admitted once, so an arm's rate r becomes L / (L / r + that cost), L the tokens a request generates.
        Through Serve at 2 clients, 48 tokens, the tree's steps ran at 9.6 tokens/s a request and the target
        alone's at ~10, while the service gave 8.0 against 9.3: the first steps and the steps beside them, not
        measured then, made the difference (the tree's first steps 0.61 s against 0.27, the other request's
        beside them 1.2-1.3 s). Charging each request B first steps instead (B the batch bucket) held there but
        not in lockstep: at 8 clients a tree step is a cycle of both models for every request, so a joining
        request's first step lasts a whole cycle (3.0 s against the target alone's 0.93) while the others'
        steps beside it are barely longer.

        Each event's excess is taken against the arm's step rate when it was recorded (``rate`` only for events
        recorded before the arm had one): against the current rate, events from a slower host's minutes all
        read as excess once it sped up (a review's simulation, the host 2x faster: the tree charged 0.93 s an
        admission where both arms' true cost was 0.25, and the target alone served at 0.98x the tree's rate)."""
        events = state.costs.get(arm, ())
        admissions = sum(1 for *_, first in events if first)
        if not admissions:
            return 0.0
        excess = math.fsum(seconds - tokens / rate if then is None else then for then, tokens, seconds, _ in events)
        return max(0.0, excess / admissions)

    def _request_tokens(self, state: _Key) -> float | None:
        """L, the tokens a request generates here (the mean of the latest requests of the key's temperature part
        that ended: ``POOLED``, every temperature, as served), when
        some have ended and both arms' admission costs are measured in this key (so both are charged, or neither).
        Not the tokens of every step over the requests begun: while the first requests run, that counts each
        at the few tokens it has so far, and the admission costs outweighed steps 2.5x faster (through Serve
        at 8 clients: the tree's first measured steps gave 4 tokens in 0.6 s against the target alone's 1 in
        0.25-0.45 s, and the target alone served the cell)."""
        lengths = self._finished.get(state.key[0])
        if not lengths or any(not any(first for *_, first in state.costs.get(arm, ())) for arm in ARMS):
            return None
        return max(1.0, mean(lengths))

    def best(self, state: _Key) -> str:
        """The faster arm (the tree until the target alone measured faster)."""
        tree, alone = (self._rate(state, arm) for arm in ARMS)
        return ALONE if tree is not None and alone is not None and alone > tree else TREE

    def _alone_below(self, key: tuple[str, int]) -> bool:
        """The nearest smaller batch bucket of ``key``'s temperature with both arms measured found the target
        alone faster (False when there is none)."""
        temperature, bucket = key
        below = [(b, state) for (t, b), state in self._keys.items() if t == temperature and b < bucket
                 and all(self._rate(state, arm) is not None for arm in ARMS)]
        return bool(below) and self.best(max(below, key=lambda item: item[0])[1]) == ALONE

    def _losing(self, state: _Key, batch: int) -> bool:
        """A served phase that has recorded a probe's worth of steps and whose arm's rate is now below the
        other arm's (both measured) by more than ``LOSING_Z`` standard errors of their difference: it ends
        early, for a probe of the other arm. Tested at every round, a plain "below" ended the noisier arm's
        phases on its dips: a review's simulation (batch 1, the tree 1 + Poisson(2) tokens a step, 1.05x the
        target alone's rate) served the tree 3-19% of the steps, where it should serve ~95%."""
        if state.probing or state.recorded < self.settings.probe_rounds * max(1, batch):
            return False
        (served, served_error), (other, other_error) = (self._rate_error(state, a) for a in (state.arm,
                                                                                              _other(state.arm)))
        if served is None or other is None:
            return False
        return served + LOSING_Z * math.hypot(served_error, other_error) < other

    def _aged(self, state: _Key, now: float) -> bool:
        """A served phase past its settling steps whose other arm last ran ``max_age_s`` ago (measured or not:
        see the module docstring)."""
        ran = state.ran.get(_other(state.arm))
        return (not state.probing and bool(self.settings.max_age_s) and ran is not None
                and state.steps >= state.settle and now - ran >= self.settings.max_age_s)

    def _first_steps_wanted(self, state: _Key, served: str) -> bool:
        """The ``served`` arm's first steps are measured here and the other's (the one probed) not, with
        probes left for them. (A served arm without first steps gets them as it serves.)"""
        return (bool(state.admits.get(served)) and not state.admits.get(_other(served))
                and state.first_probes < FIRST_STEP_PROBES)

    def _start(self, state: _Key, batch: int) -> None:
        if not state.probing:
            state.served = state.arm
        if state.probing:
            rounds = self.settings.probe_rounds
        elif self._first_steps_wanted(state, state.arm):  # the next probe comes sooner: it may see one begin
            rounds = max(1, self.settings.probe_every // FIRST_STEP_PROBES)
        else:
            rounds = self.settings.probe_every * state.spacing
        state.phase, state.steps, state.recorded = state.phase + 1, 0, 0
        state.settle = self.settings.settle_rounds * max(1, batch)
        state.length = state.settle + rounds * max(1, batch)

    def _next(self, state: _Key, batch: int) -> None:
        best = self.best(state)
        missing = next((a for a in ARMS if self._rate(state, a) is None), None)
        if missing is not None:  # an arm not measured enough yet (the first phases): measure it
            state.arm, state.probing = missing, True
        elif state.probing or state.arm != best:  # a probe ended: serve the faster arm
            confirmed = state.probing and best == state.served  # the probed arm lost again: back off
            state.spacing = self._spacing(state) if confirmed else 1
            state.arm, state.probing = best, False
        else:  # a served phase ended: probe the other arm
            state.first_probes += self._first_steps_wanted(state, state.arm)
            state.arm, state.probing = _other(best), True
        self._start(state, batch)

    def _spacing(self, state: _Key) -> int:
        """The backoff after a probe of ``state.arm`` that the served arm won: doubled, or the cap
        at once when the probed arm's rate was below ``wide`` x the served arm's."""
        probed, served = self._rate(state, state.arm), self._rate(state, _other(state.arm))
        if probed is not None and served and probed < self.settings.wide * served:
            return self.settings.backoff
        return min(2 * state.spacing, self.settings.backoff)

    def summary(self) -> dict[str, dict]:
        """Per key ``all-b8`` (the served keys: ``POOLED`` and the batch bucket): the arm served (``alone`` too where the plan is root-only now), each arm's
        measured tokens/s per request (first steps included once both arms have some; ``step_tok_s``: its steps'
        alone, ``admission_s``: the seconds each admitted request adds, None while not charged) and measured steps
        (the window's), each arm's mean first step (seconds), the
        steps each arm has run (``begun``: measured or not, since the start) and the age of each arm's newest
        measured step (``age_s``, seconds; None: none yet)."""
        with self._lock:
            out, now = {}, self.clock()
            for (temperature, bucket), state in sorted(self._keys.items()):
                rates = {arm: self._rate(state, arm, 1) for arm in ARMS}
                steps = {arm: state.rate(arm, 1, self.settings.phases) for arm in ARMS}
                admits = {a: round(mean(state.admits[a]), 3) if state.admits.get(a) else None for a in ARMS}
                charged = self._request_tokens(state) is not None
                arm = state.arm if not state.probing else self.best(state)
                out[f"{temperature}-b{bucket}"] = {
                    "serving": ALONE if state.planned_alone >= 2 * state.planned_batch else arm,
                    "tok_s": {a: None if r is None else round(r, 3) for a, r in rates.items()},
                    "step_tok_s": {a: None if r is None else round(r, 3) for a, r in steps.items()},
                    "admission_s": {a: round(self._admission(state, a, r), 3) if charged and r else None
                                    for a, r in steps.items()},
                    "first_step_s": admits,
                    "steps": {a: len(state.samples.get(a, ())) for a in ARMS}, "begun": dict(state.begun),
                    "age_s": {a: round(now - state.seen[a], 1) if a in state.seen else None for a in ARMS}}
            return out

    def policy(self, params: SamplingParams, batch: Callable[[], int] = lambda: 1,
               inner: StepPolicy | None = None) -> StepPolicy:
        """A request's step policy: the tree (``inner``'s, if given) or the target alone, as measured for its batch
        bucket (whatever ``params``' temperature: see the module docstring)."""
        return _RequestArm(self, POOLED, batch, inner)


class _RequestArm:
    def __init__(self, rates: StepRates, temperature: str, batch: Callable[[], int], inner: StepPolicy | None) -> None:
        self.rates, self.temperature, self.batch, self.inner = rates, temperature, batch, inner
        self.steps, self.step, self.tokens = 0, None, 0

    def plan(self, base: TreePlan) -> TreePlan:
        self._end_unobserved()
        self.steps += 1
        batch = max(1, self.batch())
        key = (self.temperature, batch_bucket(batch))
        if base.n <= 1:  # the bucket's plan is the target alone already (the planner measured it faster):
            self.rates.planned_alone(key, batch)  # no arm to choose, nothing to measure, no key claiming to speculate
            return base
        self.step = self.rates.begin(key, batch, self)
        if self.step.arm == ALONE:
            return ROOT_ONLY
        return self.inner.plan(base) if self.inner is not None else base

    def observe(self, plan: TreePlan, verdict: Verdict, seconds: float) -> None:
        step, self.step = self.step, None
        self.tokens += len(verdict.tokens)
        # a tree cut to the root (the request's last token) is not the tree's step; a first step (the prefill)
        # and a step beside another's prefill measure the admission cost
        if step is not None:
            first = self.steps == 1
            self.rates.record(step, len(verdict.tokens), seconds, first=first, beside=bool(verdict.prefill_beside),
                              counted=first or step.arm == ALONE or plan.n > 1)
        if self.inner is not None:
            self.inner.observe(plan, verdict, seconds)

    def finish(self) -> None:
        self._end_unobserved()
        if self.tokens:
            self.rates.finished(self.temperature, self.tokens)
        finish = getattr(self.inner, "finish", None)
        if finish is not None:
            finish()

    def _end_unobserved(self) -> None:
        """A step begun and never observed (its verdict failed) no longer marks the steps beside it."""
        if self.step is not None:
            self.rates.end(self.step)
            self.step = None
