"""What the ingress runs per request: the core ``SpeculativeDecoder`` over Ray actor handles.

The decoder is the same code as in-process; ``actors.adapters`` implements its two small protocols over
the request's draft actor and the TP ranks of its target replica. The loop runs in
a worker thread (each step blocks on the actors); the async side awaits one chunk at a time, so a client
disconnect (task cancellation) lands between steps and closing the generator frees the request's KV state
on every actor. Plans come from the plan store (latest for this hardware, pair, temperature bucket and batch
bucket), refreshed in the background; missing or broken store -> the last good plan, else a neighbour's (a
smaller batch bucket's, the nearest profiled temperature's) or the built-in one. ``LivePlanner`` learns the
acceptance vector from the verdicts and swaps in (and publishes) a re-planned tree when the served one's vector leaves its bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, replace

from deployments.config import ServeConfig
from sequoia_ray import live_acceptance
from sequoia_ray.config import SamplingParams
from sequoia_ray.draft import DynamicTrees
from sequoia_ray.dynamic_rules import DynamicRules
from sequoia_ray.engine import Chunk, SpeculativeDecoder
from sequoia_ray.hardware import BATCH_BUCKETS, HardwareProfile, batch_bucket
from sequoia_ray.live_acceptance import LiveAcceptance, LiveSettings
from sequoia_ray.plan_store import PlanKey, PlanNotFound, PlanStore, parse_bucket, plan_bucket
from sequoia_ray.request_trees import RequestTrees
from sequoia_ray.tree.builtin import builtin_plan
from sequoia_ray.tree.plan import TreePlan
from sequoia_ray.tree.plan_file import PlannedTree
from sequoia_ray.verify import Verdict

logger = logging.getLogger("sequoia_ray.serve")
_END = object()


@dataclass(frozen=True)
class ActivePlan:
    planned: PlannedTree
    source: str  # "store:<path>", "builtin", or "live:<path>" / "live" (re-planned here; published or not)
    bucket: int = 1  # the batch bucket the plan was chosen for (1 when a bigger bucket falls back to it)
    measured_otherwise: str | None = None  # a stored plan measured under another serving configuration: how


class PlanProvider:
    """The plan per temperature bucket and batch bucket: the store's latest for that bucket, else the last
    good one; a bucket with no plan of its own follows another (``_leader``): a batch bucket > 1 its
    temperature's largest smaller bucket with a plan, a temperature the store has no plan at the nearest
    temperature that has one (the same batch bucket), else the built-in plan. No store fault (unreachable, a
    bad URI, a corrupt or invalid plan file) ever reaches a request: it is logged, counted in ``errors``
    (exported as a metric and in /v1/models) and the current plan stays.

    ``get`` runs at every step of a batch: once a bucket is loaded it is a dict lookup, no I/O. ``refresh`` lists
    the pair's folders once and fetches only the buckets the store has, so clients asking many temperatures
    (each a bucket held) do not multiply the store's reads. ``plans`` is keyed by the store's folder name
    (``t0.0``, ``t0.0-b4``)."""

    def __init__(self, cfg: ServeConfig, hardware: str) -> None:
        self.cfg, self.hardware = cfg, hardware
        self.store: PlanStore | None = None
        self.plans: dict[str, ActivePlan] = {}
        self.keys: dict[str, tuple[float, int]] = {}  # folder name -> (temperature, batch bucket)
        self.follows: dict[str, str | None] = {}  # a bucket without a plan of its own -> the bucket it serves the
        # plan of (None: the built-in plan); every other bucket held has its own (the store's, or a live plan)
        self.folders: set[str] | None = None  # the bucket folders the store held at the last listing (None: unknown)
        self.seen: dict[str, str] = {}  # folder name -> the store's latest plan when last looked ("store:<path>")
        self.errors, self.last_error = 0, None
        self.warned: set[str] = set()  # what was warned about once (``_first``): plans measured otherwise, no plan
        # refresh (the ingress's loop), adopt (the live re-plan's) and a bucket's first load (a request's) run in
        # threads of their own: their changes one at a time, or a refresh that listed the store before a live plan
        # was published swaps the older plan back in, and a load that found a leader swaps its plan over the
        # bucket's own one a refresh adopted meanwhile (for good: seen already says the store's plan is served).
        # A refresh reads the store outside it (``refresh``). Re-entrant: a load loads its leader.
        self.updating = threading.RLock()
        self.counting = threading.Lock()  # ``errors``: a refresh's reads count beside a load's

    def get(self, temperature: float, batch_size: int = 1) -> ActivePlan:
        """The plan for a batch of ``batch_size`` requests at ``temperature``: its bucket's (the largest
        bucket <= batch_size, e.g. 3 -> 2)."""
        bucket = batch_bucket(batch_size)
        name = plan_bucket(temperature, bucket)
        active = self.plans.get(name)
        if active is None:  # the bucket's first request: under the lock (once loaded, a lookup without it)
            with self.updating:
                if (active := self.plans.get(name)) is None:
                    active = self._load(name, temperature, bucket)
                    logger.info("plan for %s T=%s batch bucket %d: %s (%d nodes)", self.hardware, temperature,
                                bucket, active.source, active.planned.plan.n)
        return active

    def _load(self, name: str, temperature: float, bucket: int) -> ActivePlan:
        """A bucket asked for the first time: its own plan from the store, else the plan it follows."""
        self.keys[name] = (temperature, bucket)
        if self.folders is None and not self._list():  # no store, or it cannot say what it has (counted)
            return self._follow(name)
        fetched = self._fetch(temperature, bucket) if name in self.folders else None
        if fetched is None:
            return self._follow(name)
        self.seen[name], self.plans[name] = fetched.source, fetched
        return fetched

    def _follow(self, name: str) -> ActivePlan:
        temperature, bucket = self.keys[name]
        leader = self.follows[name] = self._leader(temperature, bucket)
        if leader in self.follows:  # a follower itself (another temperature's bucket): re-pointed first, so this
            active = self._follow(leader)  # one gets its current plan (ends: a leader's leader has a plan of its own)
        elif leader is not None:
            active = self.get(*parse_bucket(leader))
        elif (current := self.plans.get(name)) is not None and current.source == "builtin":
            active = current  # the same built-in plan as before: nothing to swap
        else:
            active = ActivePlan(builtin_plan(temperature), "builtin")
        if (self.folders is not None and name not in self.folders  # (listed but unread: a store error, logged)
                and (leader is None or parse_bucket(leader)[0] != parse_bucket(name)[0])):
            what = "the built-in plan" if leader is None else f"the plan of the nearest temperature it has ({leader})"
            message = (f"no plan for hardware {self.hardware!r}, pair {self.cfg.draft or ''!r} -> {self.cfg.target!r},"
                       f" temperature {parse_bucket(name)[0]} in the store: serving {what}; run tuning/profile.py "
                       f"(`sequoia-ray profile --temperatures {parse_bucket(name)[0]}`) for a plan of its own")
            (logger.warning if self._first(f"no plan {plan_bucket(temperature)}") else logger.debug)("%s", message)
        self._swap(name, active)
        return active

    def _leader(self, temperature: float, bucket: int) -> str | None:
        """The bucket whose plan a bucket without its own serves (None: the built-in plan): the largest smaller
        batch bucket of its temperature with a plan (the store's or a live re-plan's: priced nearest its batch),
        else the nearest temperature's with a batch-1 plan (its batch bucket ``bucket``, ties to the lower), else
        built-in. Only buckets with a plan of their own lead, so no bucket ever follows itself."""
        own = [parse_bucket(n) for n in (set(self.keys) | (self.folders or set())) - set(self.follows)]
        here = parse_bucket(plan_bucket(temperature))[0]
        smaller = [b for t, b in filter(None, own) if t == here and b < bucket]
        if smaller:
            return plan_bucket(here, max(smaller))
        others = [t for t, b in filter(None, own) if b == 1 and t != here]
        if others:
            tenths = round(here * 10)  # buckets are tenths: 0.4 - 0.3 > 0.5 - 0.4 in floats, a tie in tenths
            return plan_bucket(min(others, key=lambda t: (abs(round(t * 10) - tenths), t)), bucket)
        return None

    def refresh(self) -> None:
        """Every bucket held: its own plan if the store has a new one (newer than the one last seen there, so
        a live plan that could not be published is not undone by the older one); a bucket still without one
        follows its leader's current plan (or a new leader: a temperature profiled since).

        The store is read outside the lock (a slow or stalled store must not hold up a request's first look at
        a bucket, nor a live re-plan, for the length of every read), then applied under it: a bucket whose
        ``seen`` changed meanwhile (a live plan adopted and published, another refresh) is left as it is now."""
        with self.updating:
            held, seen = dict(self.keys), dict(self.seen)
        folders = self._read_folders()
        if folders is None:
            return
        fetched = {name: self._fetch(temperature, bucket)
                   for name, (temperature, bucket) in sorted(held.items(), key=lambda kv: kv[1][1])
                   if name in folders}  # the store has nothing elsewhere: no read (a bucket keeps its plan or follows)
        with self.updating:
            self.folders = folders
            for name, fresh in fetched.items():
                if fresh is not None and fresh.source != self.seen.get(name) and self.seen.get(name) == seen.get(name):
                    self.seen[name] = fresh.source
                    self.follows.pop(name, None)
                    self._swap(name, fresh)
            self._refollow()

    def _refollow(self) -> None:
        """Re-point every bucket without a plan of its own (leaders first: batch-1 buckets before the others)."""
        for name in sorted(self.follows, key=lambda n: self.keys[n][1]):
            self._follow(name)

    def _list(self) -> bool:
        """Read which bucket folders the store has (``folders``); False when it cannot say (no store, a fault:
        counted, and every bucket keeps its plan)."""
        folders = self._read_folders()
        if folders is not None:
            self.folders = folders
        return folders is not None

    def _open_store(self) -> PlanStore:
        """The plan store, opened at its first use (a bad URI raises there, counted by the caller as a fault)."""
        self.store = self.store or PlanStore(self.cfg.plan_store, keep=self.cfg.plan_keep)
        return self.store

    def _read_folders(self) -> set[str] | None:
        """The bucket folders the store has for this hardware and pair (None: no store, or a fault, counted)."""
        if not self.cfg.plan_store:
            return None
        try:
            self._open_store()
            return self.store.plan_folders(self.hardware, self.cfg.draft or "", self.cfg.target)
        except Exception as exc:  # noqa: BLE001 - whatever the store does, serving goes on with a good plan
            self._store_error(exc, 0)
            return None

    def _swap(self, name: str, fresh: ActivePlan) -> None:
        current = self.plans.get(name)  # None: a bucket not served yet (a live re-plan covers every profiled one)
        if current is None or fresh.source != current.source or fresh.planned is not current.planned:
            # the tree too: live re-plans not published (no writable store) all have source "live"
            if current is not None:
                logger.info("new plan for %s: %s", name, fresh.source)
            self.plans[name] = fresh

    def measured_otherwise(self) -> dict[str, str]:
        """Folder name -> how the served plan's measuring configuration differs from this service's."""
        return {name: active.measured_otherwise for name, active in self.held() if active.measured_otherwise}

    def sources(self) -> dict[str, str]:
        """Folder name -> where the served plan came from (``ActivePlan.source``)."""
        return {name: active.source for name, active in self.held()}

    def held(self) -> list[tuple[str, ActivePlan]]:
        """The plans held, as one snapshot: request threads add buckets (``get``) while another thread reads
        them, and a Python loop over the dict itself would fail ("dictionary changed size during iteration")."""
        return list(self.plans.items())  # one C call: no other thread runs inside it

    def current(self, temperature: float) -> dict[int, PlannedTree]:
        """The plans served at ``temperature`` per batch bucket whose plan was made for its batch size: its own, or
        the nearest temperature's of that bucket it follows (not a smaller bucket's: the live re-plan starts
        from the trees served, and those it re-plans become this temperature's own)."""
        out = {}
        for bucket in BATCH_BUCKETS:
            active = self.plans.get(plan_bucket(temperature, bucket))
            if active is not None and active.bucket == bucket:
                out[bucket] = active.planned
        return out

    def adopt(self, temperature: float, planned: dict[int, PlannedTree],
              based_on: dict[int, PlannedTree] | None = None) -> bool:
        """Serve ``planned`` (a re-plan per batch bucket) from the next step on, publishing each new tree to the
        store as a live plan (a bucket's tree with only a new vector, ``live_acceptance.refit``, is not); buckets
        that were following this temperature's plans follow the new ones. ``based_on``: the plans the re-plan
        started from (``current``); when a refresh has swapped in another since (a newer store plan, found while the
        DP ran), nothing is adopted (False): the re-plan would overwrite it here and publish itself as the store's
        latest over it, on every replica. The next check starts from the new one."""
        with self.updating:
            now = self.current(temperature)
            if based_on is not None and (now.keys() != based_on.keys()
                                         or any(now[b] is not based_on[b] for b in based_on)):
                logger.info("a new plan for T=%s arrived during the live re-plan: not adopted, the next check "
                            "starts from it", temperature)
                return False
            self._adopt(temperature, planned)
            return True

    def _adopt(self, temperature: float, planned: dict[int, PlannedTree]) -> None:
        for bucket, tree in sorted(planned.items()):
            name = plan_bucket(temperature, bucket)
            held = self.plans.get(name)
            if (held is not None and name not in self.follows and held.bucket == bucket
                    and held.planned.plan == tree.plan):
                # the vector alone moved (``refit``; its provenance says "live") on a plan of this bucket's own:
                # served from the same source, never published (two replicas' estimates, a little apart, would
                # publish in turn). A borrowed plan (another temperature's) is published as this one's own, as a
                # new tree is: refit in place, the next ``_refollow`` put the lender's back, at every check
                self._swap(name, replace(held, planned=tree))
                continue
            path = self._publish(tree, temperature, bucket)
            if path is not None:
                self.seen[name] = f"store:{path}"  # the store's latest is this one: refresh keeps it
            self.keys[name] = (temperature, bucket)
            self.follows.pop(name, None)
            self._swap(name, ActivePlan(tree, f"live:{path}" if path else "live", bucket))
        self._refollow()  # buckets that followed this temperature's plans follow the new ones

    def _publish(self, planned: PlannedTree, temperature: float, bucket: int) -> str | None:
        if not self.cfg.plan_store:
            return None
        try:
            self._open_store()
            key = PlanKey(self.hardware, self.cfg.draft or "", self.cfg.target, temperature, bucket)
            return self.store.publish_plan(planned, key)
        except Exception as exc:  # noqa: BLE001 - the live plan is served anyway; the store is optional
            self._store_error(exc, 0, f"could not publish the live plan for T={temperature} bucket {bucket} "
                                      "(serving it anyway)")  # logged once per cause: each re-plan tries again
            return None

    def profile(self) -> HardwareProfile | None:
        """This hardware's profile from the store (None: no store, none published, or unreadable)."""
        if not self.cfg.plan_store:
            return None
        try:
            self._open_store()
            return self.store.fetch_profile(self.hardware)
        except Exception as exc:  # noqa: BLE001 - without a profile live re-planning keeps each (n, d)
            logger.debug("no hardware profile for live re-planning (%s: %s)", type(exc).__name__, exc)
            return None

    def _fetch(self, temperature: float, bucket: int) -> ActivePlan | None:
        if not self.cfg.plan_store:
            return None
        key = PlanKey(self.hardware, self.cfg.draft or "", self.cfg.target, temperature, bucket)
        skips = self.store.skips_here() if self.store else 0  # this thread's: a refresh fetches beside a load
        try:
            self._open_store()
            planned, path = self.store.fetch_plan(key)
        except PlanNotFound as exc:  # a bigger bucket without a plan of its own is normal: it uses batch 1's
            (logger.warning if bucket == 1 and self._first(str(exc)) else logger.debug)("%s", exc)
            return None
        except Exception as exc:  # noqa: BLE001 - whatever the store does, serving goes on with a good plan
            self._store_error(exc, self.store.skips_here() - skips if self.store else 0)  # the files it tried
            return None
        if (skipped := self.store.skips_here() - skips) > 0:  # newer files that did not read, skipped for an older
            with self.counting:  # good plan (logged)
                self.errors, self.last_error = self.errors + skipped, self.store.last_skip
        why = self.cfg.measured_otherwise(planned.provenance)
        if why and self._first(path):  # served all the same: a tree for this machine beats the built-in one
            logger.warning("the plan %s for T=%s batch bucket %d was measured with %s: its tree was chosen for "
                           "other costs; profile again with this configuration (scripts/main.sh does, or "
                           "`sequoia-ray profile --dtype %s%s`)", path, temperature, bucket, why, self.cfg.dtype,
                           f" --draft-quantize {self.cfg.draft_quantize}" if self.cfg.draft_quantize else "")
        return ActivePlan(planned, f"store:{path}", bucket, why)

    def _store_error(self, exc: Exception, skipped: int,
                     what: str = "plan store error, keeping the current plan") -> None:
        """A store fault while doing ``what``: logged (once per distinct error), counted (each of the ``skipped``
        files it tried, at least one)."""
        error = f"{type(exc).__name__}: {exc}"
        log = logger.error if error != self.last_error else logger.debug
        log("%s: %s", what, error)
        with self.counting:
            self.errors, self.last_error = self.errors + max(1, skipped), error

    def _first(self, key: str) -> bool:
        """Whether ``key`` (a message, a plan's path) is met for the first time, recording it: ``refresh`` looks
        every bucket up again every plan_refresh_s, and the same warning each time only buries the others."""
        first = key not in self.warned
        self.warned.add(key)
        return first


class LivePlanner:
    """Acceptance learnt from live traffic, Ray-free: ``observe`` is every decoder's ``on_verdict`` (request
    threads); ``tick`` (the ingress's background loop, every ``live_replan_s``: that is the rate limit, and it
    keeps the DP off the request path) re-plans each temperature bucket whose served vector has left the
    estimate's bound, with the hardware profile when the store has one (else each bucket keeps its (n, d)),
    and hands the new plans to ``PlanProvider.adopt``."""

    def __init__(self, cfg: ServeConfig, plans: PlanProvider) -> None:
        self.cfg, self.plans = cfg, plans
        self.live = LiveAcceptance(LiveSettings(cfg.live_min_samples, cfg.live_z, cfg.live_half_life))
        self.replans: Counter = Counter()  # temperature bucket -> live re-plans

    def observe(self, plan: TreePlan, verdict: Verdict, params: SamplingParams) -> None:
        if not verdict.ranks and plan.n > 1:  # a dynamic tree's step, its ranks withheld (biased: the engine's
            return  # ``seen``): a tree served, so not a blind step, which would fade the estimate after half_life
        self.live.observe(params.temperature, verdict.ranks)

    def tick(self) -> list[float]:
        """Re-plan where needed; the temperature buckets re-planned."""
        done, profile = [], None
        for temperature in self.live.temperatures():
            for bucket in BATCH_BUCKETS:  # every bucket's stored plan, served yet or not: a re-plan must see
                self.plans.get(temperature, bucket)  # which are the target alone by measurement (once; then cached)
            current = self.plans.current(temperature)
            if not current:
                continue
            profile = profile or self.plans.profile()
            fresh = live_acceptance.check(self.live, temperature, current, profile, self.cfg.live_max_depth)
            if fresh is not None and self.plans.adopt(temperature, fresh, based_on=current):
                self.replans[temperature] += 1
                done.append(temperature)
                logger.info("live re-plan at T=%s: %s", temperature,
                            {b: (p.plan.n, p.plan.num_levels) if b not in current or current[b].plan != p.plan
                             else "the estimate as its vector" for b, p in fresh.items()})
        return done

    def summary(self) -> dict:
        """Per temperature bucket: observations, estimate p̂ and effective trials per rank, re-plans."""
        out = {}
        for temperature in self.live.temperatures():
            snap = self.live.snapshot(temperature)
            out[f"{temperature:.1f}"] = {"samples": snap.samples, "replans": self.replans[temperature],
                                         "p": [None if x != x else round(float(x), 4) for x in snap.p_hat()],  # None: untried
                                         "trials": [round(float(x), 1) for x in snap.tried]}
        return out


class TreeFamilies:
    """Per temperature bucket, the ``RequestTrees`` of the batch-1 plan served now (a tree per request from
    its own acceptance), rebuilt when that plan changes. The profile is read from the store when a family is
    built (a plan change), never per request; without one every request keeps the served plan."""

    def __init__(self, plans: PlanProvider, max_depth: int, max_batch: int | None = None) -> None:
        self.plans, self.max_depth, self.max_batch = plans, max_depth, max_batch
        self.families: dict[str, tuple[PlannedTree, RequestTrees]] = {}  # bucket name -> (its plan, family)
        self.lock = threading.Lock()

    def get(self, temperature: float) -> RequestTrees:
        active = self.plans.get(temperature, 1)
        name = plan_bucket(temperature, 1)
        with self.lock:
            found = self.families.get(name)
            # the plan itself, not its source: live re-plans that could not be published all have source "live",
            # and from the second such re-plan on the family kept the first one's vector
            if found is None or found[0] is not active.planned:
                found = self.families[name] = (active.planned, RequestTrees(active.planned, self.plans.profile(),
                                                                            max_depth=self.max_depth,
                                                                            max_batch=self.max_batch))
            return found[1]


class GrowRules:
    """The dynamic-tree rules of the served plans (``cfg.dynamic_trees``): ``DynamicRules`` on the store's
    hardware profile, read again at every plan refresh (never per request); until one is read, no rule (every
    step grows its plan's tree). A read that finds none (or fails) keeps the rules of the last one read."""

    def __init__(self, plans: PlanProvider, extend: int) -> None:
        self.plans, self.extend = plans, extend
        self.rules: DynamicRules | None = None
        self.refresh()

    def refresh(self) -> None:
        profile = self.plans.profile()
        if profile is not None and (self.rules is None or self.rules.profile != profile):
            self.rules = DynamicRules(profile, extend=self.extend)

    def summary(self) -> dict:
        """For /v1/models: the profile pricing the trees (None: none yet, each step grows its plan), the extension."""
        rules = self.rules
        profile = None if rules is None else rules.profile.timestamp or rules.profile.hardware_id
        return {"profile": profile, "extend": self.extend}

    def for_request(self, temperature: float, batch: Callable[[], int]) -> Callable[[TreePlan], DynamicTrees | None]:
        """A decoder's ``dynamic``: each step's rule for the plan of its temperature and batch bucket."""

        def rule(plan: TreePlan) -> DynamicTrees | None:
            rules, size = self.rules, batch()
            return None if rules is None else rules.of(plan, size, self.plans.get(temperature, size).planned)

        return rule


class Runner:
    """Runs decoders in worker threads and exposes them as async chunk streams."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sequoia-request")
        # cancels (``_close``) block on the actors: threads of their own, not the event loop's default pool that
        # the ingress's other work (tokenising prompts, plan lookups) shares; at most one a request in flight
        self.cancelling = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sequoia-cancel")
        self.closing: set[asyncio.Task] = set()  # requests being freed after their caller went away

    async def stream(self, decoder: SpeculativeDecoder, prompt: list[int], params: SamplingParams,
                     request_id: str, freed: Callable[[], None] = lambda: None) -> AsyncIterator[Chunk]:
        """The request's chunks; ``freed()`` once it is freed on every actor (its step in flight over and its
        generator closed), whenever the caller stopped reading: an admission slot held until then is not given
        to another request while this one's step still runs."""
        loop = asyncio.get_running_loop()
        pending = None
        try:
            gen: Iterator[Chunk] = decoder.stream(prompt, params, request_id)
        except BaseException:
            freed()
            raise
        try:
            while True:
                pending = loop.run_in_executor(self.pool, next, gen, _END)
                chunk = await asyncio.shield(pending)
                if chunk is _END:
                    return
                yield chunk
        finally:
            # A task of its own: when the client disconnects, Starlette's StreamingResponse runs this under an
            # anyio cancel scope that cancels every await here again, so awaiting the close directly never got to
            # it (the request was freed only when garbage collection closed the generator, or its idle reaper).
            # The task runs to the end whatever happens to this await; the set holds it until then. ``freed``
            # is told when it ends, not when this await does: cancelled again, this await ends at once.
            cancel = getattr(decoder, "cancel", None)
            closing = asyncio.ensure_future(self._close(loop, gen, pending, cancel and (lambda: cancel(request_id))))
            self.closing.add(closing)
            closing.add_done_callback(self._closed)
            closing.add_done_callback(lambda _: freed())
            await asyncio.shield(closing)

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the requests being freed (``closing``); how many were still not."""
        if self.closing:
            await asyncio.wait(set(self.closing), timeout=timeout_s)
        return len(self.closing)

    def _closed(self, task: asyncio.Task) -> None:
        self.closing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # retrieved here: the caller may be gone
            logger.warning("freeing a request failed: %s: %s", type(task.exception()).__name__, task.exception())

    async def _close(self, loop, gen: Iterator[Chunk], pending, cancel: Callable[[], bool] | None) -> None:
        if pending is not None:
            if not pending.done():
                if cancel is not None:  # its caller has gone mid-step: the request is freed under the step (a long
                    try:  # prefill stops at its next chunk), in a cancel thread (the pool's may all be in steps)
                        await loop.run_in_executor(self.cancelling, cancel)
                    except Exception as exc:  # noqa: BLE001 - best effort: the close below frees it anyway
                        logger.debug("cancelling a request its caller left failed: %s", exc)
                await asyncio.wait([pending])  # the step in flight ends before the generator closes
            if not pending.cancelled():
                pending.exception()  # retrieved: raised to the caller, or its caller has gone (no "never retrieved")
        await loop.run_in_executor(self.pool, gen.close)  # frees the request on every actor
