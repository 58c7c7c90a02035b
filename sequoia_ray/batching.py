"""Continuous batching of a worker's calls: calls arrive from many threads (one per request), one thread
runs them, and every ``grow`` / ``verify`` waiting when a forward ends joins the next forward.

A request's step is one call, a finished request simply stops calling, a new one joins at the next forward,
and a client that stops reading its stream only stops sending its own calls. With ``wait_s`` 0 a forward
starts as soon as the previous one ends, with whatever is queued. Measured on a 2-core CPU that splits the
requests into groups that alternate (while one group's forward runs, the other's results travel back and
its next calls arrive just too late), so every forward carries half the requests it could. ``wait_s`` > 0
lets a forward wait, up to that long after the previous one ended, for that one's requests to come back
(see ``_wait_left``) — only those whose next call comes straight back here: a target-alone step (a
root-only ``verify``) calls ``verify`` again. A request growing trees goes to the other worker in between
(``grow`` -> ``verify`` -> ``grow``): by default it is not waited for, and tree requests fall into groups
that alternate, one drafting while the other verifies (see ``comes_straight_back``). With
``batch_wait_trees`` (``comes_back_after_any_step``) they are waited for too, and the two workers step every
request in lockstep, each idle while the other computes, every forward carrying the whole batch. On a
memory-bound CPU the alternating groups cost two forwards of each model per round where lockstep costs one,
and the two models' forwards running at once share the memory bandwidth and the cores: at 8 clients through
Serve on a 2-core Xeon, 21.0-25.5 tok/s in lockstep (1 s wait) against 14.4-18.8 alternating (session 22).

Order: every other call (``start``, ``commit``, ``finish``) runs first, in arrival order, between two
forwards; then one batch of the batched method within ``max_batch_requests`` and ``max_batch_tokens`` (a first
call larger than the token budget still runs, alone): the calls that step a request first, in arrival order,
then the calls the worker answered with ``NOT_YET`` (a long prompt prefilled one chunk per forward) in the
budget left, as vLLM's scheduler puts running requests before prefill chunks; any call passed over goes first
in the next forward (the longest passed over first), so neither decoding steps that fill the budget nor chunks
passed over in turn hold the other back for more than a forward or two (prefill chunks went first once: two
long prompts whose chunks filled the budget held a decoding request's step back until both were prefilled, 25
forwards in a review's run). A prefill chunk is cut to fit, as vLLM's are: it joins a forward with its
``fewest`` tokens (``CHUNK_FLOOR``, the worker's ``fewest_tokens_of``) and the budget the batch leaves goes
to its chunks in order, each up to its whole chunk (the worker is told each cut: ``run_batch``'s ``caps``); a chunk
cut short ``CUT_TURNS`` forwards in a row goes whole, and first, in the next.
Whole chunks that filled the budget passed a decoding step over as many forwards as prompts prefilled (more
than 7 long prompts at once with the defaults, 2,048 tokens and chunks of 256). Each call gets its own result
or exception; a batch that fails as a whole fails each of its calls.

All calls of a worker run on the batcher's one thread, so the worker itself needs no locks. The runner is
given, not assumed: in-process it is the worker; on a tensor-parallel group it is rank 0 forwarding the
whole batch to every rank as one call, so every rank runs the same collectives in the same order.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

BATCHED = {"grow": "grow_batch", "verify": "verify_batch"}
NOT_YET = "not-yet"  # a batched call that needs another step (a prefill chunk was forwarded)
CHUNK_FLOOR = 16  # the fewest tokens a prefill chunk is cut to (a worker's ``fewest_tokens_of``): a chunk of a few
# tokens costs a forward's per-request work for little progress
CUT_TURNS = 3  # forwards in a row a prefill chunk may be cut short; the next takes it whole, first: decoding steps
# that fill the budget at every forward left a chunk CHUNK_FLOOR tokens a forward (a 2,048-token prompt 114 forwards
# at a 256-token budget, against 15 whole), past the prefill deadline (timeout_s a chunk) on a slow host
GATHER_S = 0.05  # with ``batch_wait_trees``, how long both workers wait from a batch's first queued call for the
# rest of it (one forward's results come back as calls a few ms apart); only the target waits ``wait_s`` too
LOCKSTEP_LOOKBACK = 2  # with ``batch_wait_trees``: the requests of the last two forwards are waited for (two
# groups alternating between the workers are each in one of them: waiting for both merges them)


@dataclass
class BatchLimits:
    max_batch_requests: int = 16
    max_batch_tokens: int = 2048
    wait_s: float = 0.0  # how long a forward may wait for the previous one's requests that come straight back
    gather_s: float = 0.0  # ... and how long after its first queued call arrived (whichever ends later)

    def __post_init__(self) -> None:
        if self.wait_s < 0 or self.gather_s < 0:
            raise ValueError(f"batch wait {self.wait_s} s and gather {self.gather_s} s must be >= 0 (0 = start each "
                             "forward at once)")
        if self.max_batch_requests < 1:
            raise ValueError(f"max_batch_requests {self.max_batch_requests} must be >= 1 (1 = one request per forward)")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} must be >= 1")


TRACE_KEEP = 4096  # forwards a batcher remembers for ``trace`` (~15 minutes at 5 forwards a second)


@dataclass(frozen=True)
class Forward:
    """One batch a batcher ran: what ``Batcher.trace`` returns. Times are ``time.monotonic()``, one clock for
    every process of a host, so two actors' traces (the draft's and the target's) line up."""

    method: str  # "grow" or "verify"
    start: float
    end: float
    calls: int  # requests in the batch
    trees: int  # of them, calls stepping a tree (every grow; a verify of more than the root)
    tokens: int  # its first forward's tokens, as the token budget counts them (``size``: catch-up, prefill, tree)
    queued: float  # when its first call was queued: start - queued is how long the batch gathered


@dataclass
class _Call:
    method: str
    request_id: str
    args: tuple
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)
    prefilling: bool = False  # answered NOT_YET: the rest of a long prompt, one chunk per forward
    passed: int = 0  # forwards that ran without it while it was queued (a call passed over goes first)
    cap: int | None = None  # tokens its chunk is cut to in the forward it joins (None: its whole ``size``)
    cut: int = 0  # forwards in a row its chunk was cut short (CUT_TURNS of them: the next takes it whole)


class Batcher:
    """``call(method, request_id, *args)`` from any thread; returns what the worker returned, or raises.
    ``run_batch(method, calls, caps)``: ``caps`` maps a request to the tokens its prefill chunk is cut to in this
    forward (``fewest``: a call's fewest tokens, None: every call runs whole)."""

    fewest: Callable[[str, str, tuple], int] | None = None

    def __init__(self, run_batch: Callable[[str, list[tuple], dict[str, int]], list],
                 run_one: Callable[..., object], size: Callable[[str, str, tuple], int], limits: BatchLimits, *,
                 name: str = "batcher", comes_back: Callable[[str, tuple], bool] | None = None, lookback: int = 1,
                 fewest: Callable[[str, str, tuple], int] | None = None) -> None:
        self.run_batch, self.run_one, self.size, self.limits, self.fewest = run_batch, run_one, size, limits, fewest
        self.comes_back = comes_back or comes_straight_back
        self.queue: deque[_Call] = deque()
        self.cond = threading.Condition()
        self.batch_sizes: Counter[int] = Counter()  # requests per forward -> forwards (stats, tests)
        self.recent: deque[set[str]] = deque(maxlen=lookback)  # per forward of the last ``lookback``: its
        # requests coming back, not finished
        self.last_end = 0.0  # when the last forward ended (time.monotonic)
        self.started = time.monotonic()
        self.busy_s = 0.0  # seconds spent running batches (stats: busy_s / running time is the utilization)
        self.forwards: deque[Forward] = deque(maxlen=TRACE_KEEP)
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    @classmethod
    def over(cls, worker, limits: BatchLimits, *, name: str = "batcher",
             comes_back: Callable[[str, tuple], bool] | None = None) -> Batcher:
        """A batcher running an in-process worker's own methods."""
        return cls(lambda method, calls, caps: getattr(worker, BATCHED[method])(calls, caps),
                   lambda method, rid, *args: getattr(worker, method)(rid, *args),
                   worker.tokens_of, limits, name=name, comes_back=comes_back, fewest=worker.fewest_tokens_of)

    def call(self, method: str, request_id: str, *args):
        item = _Call(method, request_id, args)
        with self.cond:
            if self.closed:
                raise RuntimeError("the batcher is closed")
            self.queue.append(item)
            self.cond.notify()
        while True:
            try:
                return item.future.result(timeout=1.0)
            except FutureTimeout:
                if not self.thread.is_alive():  # never wait for ever on a thread that is gone
                    raise RuntimeError("the batcher's thread has died; this actor must be replaced") from None

    def waiting(self) -> list[str]:
        """The requests with a call in the queue now (not yet run)."""
        with self.cond:
            return [c.request_id for c in self.queue]

    def stats(self) -> dict[int, int]:
        """Requests per forward -> forwards run so far."""
        with self.cond:
            return dict(self.batch_sizes)

    def utilization(self) -> dict[str, float]:
        """Seconds running batches and seconds since the batcher started: how much of its time the worker
        computed (the rest it waited for calls: requests on their way back, or no load)."""
        with self.cond:
            return {"busy_s": self.busy_s, "running_s": time.monotonic() - self.started}

    def trace(self, since: float = 0.0) -> list[Forward]:
        """The batches that began at or after ``since`` (``time.monotonic()``), oldest first; the last
        ``TRACE_KEEP`` are kept."""
        with self.cond:
            return [f for f in self.forwards if f.start >= since]

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                if self.closed:
                    self._fail_all(RuntimeError("the batcher is closed"))
                    return
                singles = [c for c in self.queue if c.method not in BATCHED]
                self.queue = deque(c for c in self.queue if c.method in BATCHED)
                wait = 0.0 if singles else self._wait_left()
                if wait > 0:
                    self.cond.wait(wait)  # a call arriving (or a finish) wakes it: then look again
                    continue
                batch, tokens = ([], 0) if singles else self._take()  # after singles, look again: a wait may be due
            for item in singles:
                if item.method == "finish":
                    for seen in self.recent:
                        seen.discard(item.request_id)
                _settle(item, lambda i=item: self.run_one(i.method, i.request_id, *i.args))
                if item.method == "start" and item.future.exception() is None and self._back(item):
                    self._expect(item.request_id)
            if batch:
                self._run_guarded(batch, tokens)

    def _wait_left(self) -> float:
        """Seconds the next forward should still wait: while a request of the last ``lookback`` forwards that
        comes back (``comes_back``) has no call queued yet (it is on its way back: the requests then share one
        forward instead of alternating in two, which halves every batch), up to ``wait_s`` after the last
        forward ended or ``gather_s`` after the first queued call arrived, whichever is later; 0 when nobody is
        missing, the batch is full, or both limits are 0. A request that does not come back in time (a client
        that stopped reading, a request whose next step grows a tree after all) is waited for ``lookback``
        times at most: it is not in the next forwards, so once they are ``lookback``, nobody waits for it."""
        expected = self.expected
        if max(self.limits.wait_s, self.limits.gather_s) <= 0 or not expected:
            return 0.0
        queued = {c.request_id for c in self.queue}
        if len(queued) >= self.limits.max_batch_requests or expected <= queued:
            return 0.0
        first = min((c.arrived for c in self.queue), default=time.monotonic())
        return max(0.0, max(self.last_end + self.limits.wait_s, first + self.limits.gather_s) - time.monotonic())

    @property
    def expected(self) -> set[str]:
        """The requests of the last ``lookback`` forwards that come back, not finished."""
        return set().union(*self.recent)

    def _expect(self, request_id: str) -> None:
        """A request just started here: its first batched call comes next, so the next forwards wait for it as
        for one of the last forward's (``lookback`` forwards at most). A request that starts while the others'
        calls gather (its first ``grow`` a round trip behind them) then joins their forward instead of running
        alone right after it."""
        with self.cond:
            if not self.recent:
                self.recent.append(set())
            self.recent[-1].add(request_id)

    def _run_guarded(self, batch: list[_Call], tokens: int) -> None:
        start = time.monotonic()
        try:
            self._run(batch)
        except BaseException as exc:  # noqa: BLE001 - the loop must outlive any batch
            for c in batch:
                if not c.future.done():
                    c.future.set_exception(exc)
        finally:
            with self.cond:
                self.recent.append({c.request_id for c in batch if self._back(c)})
                self.last_end = time.monotonic()
                self.busy_s += self.last_end - start
                trees = sum(not comes_straight_back(c.method, c.args) for c in batch)
                self.forwards.append(Forward(batch[0].method, start, self.last_end, len(batch), trees, tokens,
                                             min(c.arrived for c in batch)))

    def _back(self, c: _Call) -> bool:
        if c.future.done() and c.future.exception(timeout=0) is not None:  # ended (finished, failed): not back
            return False
        try:
            return bool(self.comes_back(c.method, c.args))
        except Exception:  # noqa: BLE001 - a guess about the next call never fails the loop: do not wait
            return False

    def _take(self) -> tuple[list[_Call], int]:
        """The queued calls of the next forward within the limits, and their tokens: the calls passed over before
        (longest first), the calls stepping a request in arrival order, then the other prefill chunks
        (``prefilling``) in the budget left."""
        def rank(c: _Call) -> tuple[int, int]:  # any call passed over first (a prefill chunk or a step that chunks
            # passed over first crowded out), the longest passed over first, with a chunk cut short CUT_TURNS times;
            # then steps; then chunks
            if c.passed or c.cut >= CUT_TURNS:
                return 0, -c.passed
            return (2 if c.prefilling else 1), 0

        order = sorted(self.queue, key=rank)  # stable: arrival order within each group
        batch, tokens, skipped, wholes = [], 0, False, {}
        for c in order:
            whole, fewest = self._sizes(c)
            if skipped or not self._fits(c, batch, tokens + fewest):  # in order: no call jumps one that did not fit
                skipped = True
                continue
            batch.append(c)
            tokens, wholes[id(c)], c.cap = tokens + fewest, whole, fewest
        left = max(0, self.limits.max_batch_tokens - tokens)
        for c in batch:  # the budget left to the chunks, in order, each up to its whole chunk
            more = min(wholes[id(c)] - c.cap, left)
            left, tokens = left - more, tokens + more
            c.cap = c.cap + more if c.cap + more < wholes[id(c)] else None
        taken = {id(c) for c in batch}
        self.queue = deque(c for c in self.queue if id(c) not in taken)
        for c in self.queue:
            c.passed += 1
        for c in batch:
            c.passed, c.cut = 0, (c.cut + 1 if c.cap is not None else 0)
        return batch, tokens

    def _fits(self, c: _Call, batch: list[_Call], tokens: int) -> bool:
        """Whether ``c`` joins ``batch``, the batch then ``tokens`` tokens."""
        if not batch:
            return True  # a first call larger than the token budget still runs, alone
        return (c.method == batch[0].method and len(batch) < self.limits.max_batch_requests
                and all(b.request_id != c.request_id for b in batch)  # a request's two calls: two forwards
                and tokens <= self.limits.max_batch_tokens)

    def _sizes(self, c: _Call) -> tuple[int, int]:
        """A call's tokens whole and the fewest it can run with (a prefill chunk cut short: ``fewest``; whole after
        CUT_TURNS cuts in a row)."""
        whole = self._size(c)
        if self.fewest is None or c.cut >= CUT_TURNS:
            return whole, whole
        try:
            return whole, max(1, min(whole, self.fewest(c.method, c.request_id, c.args)))
        except Exception:  # noqa: BLE001 - as ``_size``: its call fails in the batch
            return whole, whole

    def _size(self, c: _Call) -> int:
        try:
            return self.size(c.method, c.request_id, c.args)
        except Exception:  # noqa: BLE001 - an unknown request costs nothing; its call fails in the batch
            return 1

    def _run(self, batch: list[_Call]) -> None:
        try:
            results = list(self.run_batch(batch[0].method, [(c.request_id, *c.args) for c in batch],
                                          {c.request_id: c.cap for c in batch if c.cap is not None}))
        except BaseException as exc:  # noqa: BLE001 - the whole forward failed: each of its calls fails
            for c in batch:
                c.future.set_exception(exc)
            return
        if len(results) != len(batch):
            raise RuntimeError(f"a batch of {len(batch)} calls returned {len(results)} results")
        with self.cond:
            self.batch_sizes[len(batch)] += 1
        again = []
        for c, result in zip(batch, results):
            if isinstance(result, str) and result == NOT_YET:
                c.prefilling = True
                again.append(c)
            elif isinstance(result, BaseException):
                c.future.set_exception(result)
            else:
                c.future.set_result(result)
        if again:
            with self.cond:
                self.queue.extendleft(reversed(again))

    def _fail_all(self, exc: Exception) -> None:
        while self.queue:
            self.queue.popleft().future.set_exception(exc)


def comes_straight_back(method: str, args: tuple) -> bool:
    """Whether a request's next call after this one is likely to this same worker: after a root-only
    ``verify`` (the target alone) it is — the next step verifies again — while a tree step goes on to the
    other worker (``grow`` is followed by ``verify``, a tree's ``verify`` by the next ``grow``)."""
    return method == "verify" and bool(args) and getattr(args[0], "n", None) == 1


def comes_back_after_any_step(method: str, args: tuple) -> bool:
    """The guess when tree requests are waited for too (``batch_wait_trees``): a request's next call after any
    ``grow`` or ``verify`` comes back to the same worker, one call to the other worker in between (a tree step
    is ``grow`` -> ``verify`` -> ``grow``), so a forward waits for its previous batch and the two workers step
    every request in lockstep; after a ``start`` its first batched call comes here next. Only the target waits
    long (``wait_s``); the draft only gathers (``gather_s`` from its first queued call): when the requests are
    split in two groups, one queued on each worker, two long waits would each wait for the group the other
    holds, at every step."""
    return method in BATCHED or method == "start"


def _settle(item: _Call, run: Callable[[], object]) -> None:
    try:
        item.future.set_result(run())
    except BaseException as exc:  # noqa: BLE001 - the caller's thread re-raises it
        item.future.set_exception(exc)


# The calls a Draft or Target worker answers (the engine's protocols; ``commit``: a draft's verdicts sent apart
# from a grow, as ``ActorDraft.commit`` does): what a proxy of a worker forwards (a queue, a pipe), and nothing
# else, so the engine's optional attributes (``max_context``, ``abandon``) read as absent rather than as a call.
WORKER_CALLS = ("start", "grow", "verify", "commit", "finish")


class BatchedWorker:
    """The engine's Draft / Target protocol over a ``Batcher``: each method is one queued call. ``max_context``:
    the positions its worker's model reads (the engine's ``draft_levels``), None for no limit."""

    calls_from_any_thread = True  # each call is queued (``SpeculativeDecoder.cancel`` may finish from another thread)

    def __init__(self, batcher: Batcher, max_context: int | None = None) -> None:
        self.batcher, self.max_context = batcher, max_context

    def __getattr__(self, method: str):
        if method not in WORKER_CALLS:
            raise AttributeError(method)
        return lambda request_id, *args: self.batcher.call(method, request_id, *args)
