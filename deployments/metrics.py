"""Prometheus metrics of the service, through ``ray.serve.metrics`` (exported by every Ray node's metrics
agent; names are prefixed ``ray_`` there)."""

from __future__ import annotations

from ray.serve import metrics

from sequoia_ray.engine import Stats
from sequoia_ray.live_acceptance import LiveAcceptance
from sequoia_ray.plan_store import parse_bucket, temperature_bucket

STEP_BOUNDS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
# a first token waits for its prompt's prefill and for a place in the batch: on CPU a long prompt under load takes
# tens of seconds, which all fell in the +Inf bucket past 5 s (no quantile could be read there)
TTFT_BOUNDS = STEP_BOUNDS + [10.0, 20.0, 30.0, 60.0, 120.0]
PLAN_KINDS = ("store", "live", "builtin")  # what ``ActivePlan.source`` begins with (deployments.service)


def plan_kind(source: str) -> str:
    """The kind of a plan's ``source`` ("store:<path>", "live:<path>", "live", "builtin"): a label from a fixed
    set. The path is new at every publish and live re-plan, so as a label it made a time series per plan ever
    served, without end."""
    kind = source.split(":", 1)[0]
    return kind if kind in PLAN_KINDS else "other"


GAUGE_REFRESH_S = 5.0  # how often the ingress sets its gauges' last values again (``ServiceMetrics.refresh``)


class HeldGauge:
    """A gauge whose last value per series is set again by ``refresh``. Ray's metrics agent drops a gauge value
    two report intervals after it was set (~20 s with Ray's defaults): a value set per request or per live
    check (60 s) was mostly gone when Prometheus scraped (a new user's 17 minutes of scrapes never saw
    ``sequoia_plan_nodes`` nor the live estimate, and saw ``sequoia_active_requests`` vanish when idle).
    ``series``: the tags naming a series (default: all); a value set with other values of the rest replaces
    the one held (the plan-size gauge keeps one source per temperature: the kind served last)."""

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...] = (), *,
                 series: tuple[str, ...] | None = None) -> None:
        self.gauge = metrics.Gauge(name, description, tag_keys=tag_keys)
        self.series, self.held = series, {}

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        tags = dict(tags or {})
        self.held[tuple(sorted((k, v) for k, v in tags.items() if self.series is None or k in self.series))] = (
            value, tags)
        self.gauge.set(value, tags=tags or None)

    def refresh(self) -> None:
        for value, tags in list(self.held.values()):  # a snapshot: a request may set one meanwhile
            self.gauge.set(value, tags=tags or None)


class ServiceMetrics:
    def __init__(self) -> None:
        self.requests = metrics.Counter("sequoia_requests", "Requests by route and HTTP status.",
                                        tag_keys=("route", "status"))
        self.tokens = metrics.Counter("sequoia_generated_tokens", "Tokens generated.")
        self.tokens_per_step = metrics.Histogram("sequoia_tokens_per_step", "Tokens per target call, per request.",
                                                 boundaries=[1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12])
        self.tree_nodes = metrics.Histogram("sequoia_tree_nodes_per_step", "Tree nodes verified per target call (root "
                                            "included; dynamic trees as grown), per request.",
                                            boundaries=[1, 2, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024])
        # acceptance as two counters (a ratio of rates), not a gauge of the last request: that one was a random
        # request's under concurrency, held for hours after traffic stopped, and counted the steps that ran the
        # target alone (a first step, a live-cost probe, a root-only plan) as rejections
        self.tree_steps = metrics.Counter("sequoia_tree_steps", "Steps that verified a draft tree.")
        self.accepted_steps = metrics.Counter("sequoia_accepted_steps",
                                              "Tree steps that accepted >= 1 draft token.")
        self.ttft = metrics.Histogram("sequoia_time_to_first_token_s", "Seconds from the request's arrival to its "
                                      "first text (or its end).", boundaries=TTFT_BOUNDS)
        self.draft_step = metrics.Histogram("sequoia_draft_step_s", "Draft seconds per tree step, per request.",
                                            boundaries=STEP_BOUNDS)
        self.verify_step = metrics.Histogram("sequoia_verify_step_s", "Verify seconds per step.",
                                             boundaries=STEP_BOUNDS)
        self.active = HeldGauge("sequoia_active_requests", "Requests in flight on this ingress replica.")
        self.plan = HeldGauge("sequoia_plan_nodes", "Nodes of the plan in use (tags: hardware, source = its kind: "
                              "store | live | builtin, temperature bucket, batch bucket).",
                              tag_keys=("hardware", "source", "temperature", "batch"),
                              series=("hardware", "temperature", "batch"))
        self.store_errors = metrics.Counter("sequoia_plan_store_errors", "Plan store reads that failed.")
        self.live_p = HeldGauge("sequoia_live_acceptance", "Live estimate of p[k] per temperature bucket and rank k "
                                "(once the rank has had live_min_samples trials).", tag_keys=("temperature", "rank"))
        self.live_trials = HeldGauge("sequoia_live_trials", "Effective trials (decayed) behind the live p[k].",
                                     tag_keys=("temperature", "rank"))
        self.live_samples = HeldGauge("sequoia_live_samples", "Inner-node observations since the start.",
                                      tag_keys=("temperature",))
        self.live_replans = metrics.Counter("sequoia_live_replans", "Plans re-planned from live acceptance.",
                                            tag_keys=("temperature",))
        self.step_rate = HeldGauge("sequoia_step_rate", "Measured tokens/s per request with the tree or the target "
                                   "alone (arm), per temperature and batch bucket.",
                                   tag_keys=("temperature", "batch", "arm"))
        self.speculating = HeldGauge("sequoia_speculating", "1 where the tree measures faster than the target "
                                     "alone and is served, per batch bucket (temperature 'all': one arm serves a batch's "
                                     "requests of every temperature).",
                                     tag_keys=("temperature", "batch"))

    def refresh(self) -> None:
        """Every gauge's last values set again (``HeldGauge``); the ingress calls it every GAUGE_REFRESH_S."""
        for gauge in vars(self).values():
            if isinstance(gauge, HeldGauge):
                gauge.refresh()

    @staticmethod
    def plan_tags(hardware: str, source: str, temperature: float, batch: int = 1) -> dict[str, str]:
        """``sequoia_plan_nodes``'s tags for the plan from ``source`` served at ``temperature`` and batch bucket
        ``batch``: bounded values only (the hardware, the plan's kind, the temperature bucket as the store names
        it: ``t0.6`` -> "0.6", the batch bucket)."""
        return {"hardware": hardware, "source": plan_kind(source), "temperature": temperature_bucket(temperature)[1:],
                "batch": str(batch)}

    def plans(self, hardware: str, held) -> None:
        """``sequoia_plan_nodes`` for every bucket held (``PlanProvider.held()``: (folder name, ActivePlan)), set
        with the gauges' refresh: set per request only, it went on showing a plan a refresh or a live re-plan had
        replaced until the bucket's next request."""
        for name, active in held:
            temperature, batch = parse_bucket(name) or (None, None)
            if temperature is not None:
                self.plan.set(active.planned.plan.n, tags=self.plan_tags(hardware, active.source, temperature, batch))

    def step_rates(self, summary: dict[str, dict]) -> None:
        """Export ``StepRates.summary()``: per key, each arm's measured tokens/s per request and the arm served."""
        for key, entry in summary.items():
            temperature, batch = key.split("-b")
            tags = {"temperature": temperature.removeprefix("t"), "batch": batch}  # "all": every temperature
            self.speculating.set(1.0 if entry["serving"] == "tree" else 0.0, tags=tags)
            for arm, rate in entry["tok_s"].items():
                if rate is not None:
                    self.step_rate.set(rate, tags=tags | {"arm": arm})

    def live(self, live: LiveAcceptance, replanned: list[float]) -> None:
        """Export the live estimate of every temperature bucket, and count ``replanned``."""
        for temperature in replanned:
            self.live_replans.inc(tags={"temperature": f"{temperature:.1f}"})
        for temperature in live.temperatures():
            snap, label = live.snapshot(temperature), f"{temperature:.1f}"
            self.live_samples.set(snap.samples, tags={"temperature": label})
            for k, (p, tried, settled) in enumerate(zip(snap.p_hat(), snap.tried, snap.settled), start=1):
                tags = {"temperature": label, "rank": str(k)}
                self.live_trials.set(float(tried), tags=tags)
                if settled:  # a rank with a trial or two read 0 or 1 (the planner gives it the prior or its bound)
                    self.live_p.set(float(p), tags=tags)

    def generated(self, tokens: int) -> None:
        """Tokens a chunk brought (the usage's completion tokens), counted as they go out: counted at the end
        only, a request whose client left (or whose target failed) mid-stream counted none."""
        if tokens:  # Ray counters reject inc(0) (a chunk of held-back text, an EOS as the first token)
            self.tokens.inc(tokens)

    def finished(self, stats: Stats) -> None:
        """A finished request's per-step figures."""
        if stats.steps:
            self.tokens_per_step.observe(stats.tokens_per_step)
            self.tree_nodes.observe(stats.tree_nodes / stats.steps)
            self.verify_step.observe(stats.verify_s / stats.steps)
        if trees := stats.tree_steps:
            self.tree_steps.inc(trees)
            if accepted := sum(v for k, v in stats.accepted_hist.items() if k > 0):
                self.accepted_steps.inc(accepted)
            self.draft_step.observe(stats.draft_s / trees)
