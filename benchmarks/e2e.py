"""End to end on the real pair: the plan this machine serves against the best fixed plan in hindsight,
transformers' assisted generation and the target alone.

    .venv/bin/python benchmarks/e2e.py [--dtype bfloat16] [--draft-quantize int8] [--limit 3] [--max-tokens 64]
                                       [--temperatures 0,0.6] [--profile-seconds 120] [--device auto|cpu|cuda]

The served plan is what the main job would serve here: ``run_bounded`` (the launcher's bounded profile:
t(n) and c, p measured on the profiler's own built-in prompts — never on these —, the DP, the overhead
measured on real steps, the measured choice among the model's best trees) into a scratch plan store, its
batch-1 plan per temperature. Then, on the same benchmark prompts (benchmarks/prompts.jsonl: code and prose),
in one run per temperature: the target alone; assisted generation with the same draft (its default schedule
and num_assistant_tokens 3, 5, 8, constant); every fixed Sequoia plan of the hindsight grid (the DP's tree for
the served acceptance vector at n in --grid-n, d in --grid-d); the built-in plan; the served plan (and the cost
model's own pick when the measured choice published another); ADAPTIVE: the served plan with a tree per
request (``RequestTrees``: each request's own p̂[1] picks the cost model's tree for its tilted vector); DYNAMIC:
the served plan grown as a dynamic tree by the cost model's rule (``DynamicRules``: the draft drops branches
and levels worth less than their cost); ADAPTIVE+DYNAMIC: both; with --dynamic-extend K, DYNAMIC+EXTEND K: a
confident path may also grow K levels beyond the plan, and ADAPTIVE+DYNAMIC+EXTEND K: that with a tree per
request. The configs run interleaved, prompt by prompt (``run_configs``). tokens/s = total tokens / total wall
time (prefill included), per prompt kind; columns: x target, x assisted (the best assisted setting), x best
fixed (the best grid plan of that kind and temperature); then the served plan's predicted speedup (the profile's)
beside its measured one. Writes benchmarks/results/e2e.json.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from dataclasses import asdict
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.arguments import FULL, positive_int, vocab_size  # noqa: E402
from sequoia_ray.config import DEFAULT_DRAFT_VOCAB, ProfileJobConfig, SamplingParams  # noqa: E402
from sequoia_ray.devices import DEVICE_CHOICES, resolve_device, synchronize  # noqa: E402
from sequoia_ray.dynamic_rules import DynamicRules  # noqa: E402
from sequoia_ray.hardware import HardwareProfile, accelerator_name, hardware_id  # noqa: E402
from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.plan_store import PlanKey, PlanStore  # noqa: E402
from sequoia_ray.profiling import Serving, TrialResult, format_results, run_bounded  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.request_trees import RequestTrees  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402
from sequoia_ray.tree.dp import solve  # noqa: E402
from sequoia_ray.tree.plan import chain  # noqa: E402
from sequoia_ray.tree.plan_file import PlannedTree  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_ours(pair: LocalPair, plan, prompts, *, temperature: float, max_tokens: int, speculate: bool = True,
             policy=None, dynamic=None, first_seed: int = 0):
    decoder = pair.decoder(plan, speculate=speculate, policy=policy, dynamic=dynamic)
    tokens = steps = 0
    seconds = 0.0
    for i, prompt in enumerate(prompts, start=first_seed):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i)
        start = time.perf_counter()
        out = decoder.generate(prompt, params)
        seconds += time.perf_counter() - start
        tokens += out.stats.tokens
        steps += out.stats.steps
    return tokens, seconds, steps


def run_assisted(pair: LocalPair, prompts, temperature: float, max_tokens: int, first_seed: int = 0):
    target, draft = pair.target.model, pair.draft.model
    device = target.device
    tokens, seconds = 0, 0.0
    for i, prompt in enumerate(prompts, start=first_seed):
        torch.manual_seed(i)  # transformers' sampling reads the global generator
        ids = torch.tensor([prompt], device=device)
        sample = {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {
            "do_sample": False}
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                              max_new_tokens=max_tokens, eos_token_id=list(pair.target.eos_ids),
                              pad_token_id=pair.target.eos_ids[0], **sample)
        synchronize(device)  # generate returns before a GPU has finished; our decoder returns python ints
        seconds += time.perf_counter() - start
        tokens += until_eos(out[0, ids.shape[1]:].tolist(), pair.target.eos_ids)
    return tokens, seconds, None


def until_eos(ids: list[int], eos_ids) -> int:
    """Tokens before the first EOS id: transformers returns the EOS it stopped on, our decoder's count stops
    before it (``sequoia_ray.stopping.StopChecker``)."""
    return next((i for i, token in enumerate(ids) if token in eos_ids), len(ids))


def _hardware(pair: LocalPair) -> str:
    return hardware_id(accelerator_name(pair.target.model.device))


def served_plans(pair: LocalPair, args, temperatures: list[float]
                 ) -> tuple[dict[float, tuple[TrialResult, PlannedTree]], HardwareProfile]:
    """What the main job would serve on this machine: its bounded profile, run here into a scratch store;
    the batch-1 plan per temperature and the profile."""
    job = ProfileJobConfig(storage=args.plan_store or tempfile.mkdtemp(prefix="e2e-plans-"), temperatures=tuple(temperatures),
                           dtype=args.dtype, draft_quantize=args.draft_quantize, device=args.device,
                           draft_vocab=args.draft_vocab)
    hardware = _hardware(pair)
    results = run_bounded(job, hardware, Serving(torch.get_num_threads(), args.profile_seconds), pair=pair)
    print(f"{format_results(results)}\nplans published under {job.storage}", flush=True)
    store, out = PlanStore(job.storage), {}
    for r in (r for r in results if r.batch == 1):
        planned, _ = store.fetch_plan(PlanKey(hardware, "default-draft", "default-target", r.temperature))
        out[r.temperature] = (r, planned)
    return out, store.fetch_profile(hardware)


def assisted_configs(pair: LocalPair, temperature: float, max_tokens: int) -> list[tuple[str, object]]:
    """Assisted generation with transformers' default schedule, then num_assistant_tokens 3, 5, 8 constant. The
    draft's generation_config holds the setting: each run sets its own and restores the defaults read here,
    so the next call (the next temperature) reads the draft's defaults again, not the last k run."""
    cfg = pair.draft.model.generation_config
    defaults = (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule)

    def run(ps, k=None, first_seed=0):
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = defaults if k is None else (k, "constant")
        try:
            return run_assisted(pair, ps, temperature, max_tokens, first_seed)
        finally:
            cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = defaults

    return [("assisted default", run)] + [(f"assisted k={k}", functools.partial(run, k=k)) for k in (3, 5, 8)]


def plan_configs(pair: LocalPair, temperature: float, result: TrialResult, planned: PlannedTree, args,
                 profile: HardwareProfile) -> list[tuple[str, object]]:
    table = solve(planned.acceptance, max(args.grid_n + [result.model_n or 1]),  # every n asked of it below
                  max(args.grid_d + [planned.max_depth or 1, result.model_d]))
    plans = [(f"grid n={n} d={d}", table.tree(n, d)) for n in args.grid_n for d in args.grid_d]
    plans.append((f"built-in n={builtin_plan(temperature).budget}", builtin_plan(temperature).plan))
    if (result.model_n, result.model_d) != (result.n, result.d) and result.model_n:
        plans.append((f"model pick n={result.model_n} d={result.model_d}", table.tree(result.model_n, result.model_d)))
    plans.append((f"SERVED n={result.n} d={result.d}", planned.plan))
    configs = [(name, functools.partial(run_ours, pair, plan, temperature=temperature, max_tokens=args.max_tokens))
               for name, plan in plans]
    family = RequestTrees(planned, profile, max_depth=max(args.grid_d))  # the served plan, a tree per request
    rules = {"prune": DynamicRules(profile).for_planned(planned)}  # the served plan, pruned
    if args.dynamic_extend:  # and extended: a confident path grows up to that many levels beyond the plan
        rules["extend"] = DynamicRules(profile, extend=args.dynamic_extend).for_planned(planned)
    for name, per_request, dynamic in VARIANTS.values():
        if dynamic is None or dynamic in rules:
            kw = ({"policy": family.policy} if per_request else {}) | ({"dynamic": rules[dynamic]} if dynamic else {})
            label = f"{name} {args.dynamic_extend}" if dynamic == "extend" else name
            configs.append((f"{label} from n={result.n} d={result.d}", functools.partial(
                run_ours, pair, planned.plan, temperature=temperature, max_tokens=args.max_tokens, **kw)))
    return configs


def ratios(rows: list[dict]) -> None:
    """x assisted and x best fixed, per temperature and prompt kind."""
    for key in {(r["T"], r["kind"]) for r in rows}:
        sub = [r for r in rows if (r["T"], r["kind"]) == key]
        assisted = max(r["tok/s"] for r in sub if r["config"].startswith("assisted"))
        fixed = max(r["tok/s"] for r in sub if r["config"].startswith("grid"))
        for r in sub:
            r["x assisted"], r["x best fixed"] = r["tok/s"] / assisted, r["tok/s"] / fixed


def sizes(text: str) -> list[int]:
    """Comma-separated integers >= 1 (``--grid-n``, ``--grid-d``): a bad one fails at parsing, before the pair
    loads and the profile runs."""
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def pair_options(draft_quantize: str, device: str) -> tuple[str | None, str]:
    """(draft_quantize, device) for ``LocalPair.load`` from the command line's: ``auto`` is int8 on the CPU (the
    serving default there), none on a GPU (int8 is CPU-only); an int8 draft puts an ``auto`` device on the CPU,
    so the pair and the profile both run there."""
    if draft_quantize == "auto":
        draft_quantize = "int8" if resolve_device(device).type == "cpu" else "none"
    draft_quantize = None if draft_quantize == "none" else draft_quantize
    if draft_quantize == "int8" and device == "auto":
        device = "cpu"
    return draft_quantize, device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft-quantize", default="auto", choices=["auto", "none", "int8"],
                    help="auto: int8 on the CPU (the serving default there), none on a GPU (int8 is CPU-only)")
    ap.add_argument("--draft-vocab", type=vocab_size, default=DEFAULT_DRAFT_VOCAB,
                    help="ids kept in the draft's LM head, or 'full' (the serving default: %(default)s); transformers' "
                         "assisted generation runs the same draft model, head included")
    ap.add_argument("--limit", type=int, default=3, help="prompts per kind")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--grid-n", type=sizes, default="4,8,16,32", help="tree sizes n of the hindsight grid")
    ap.add_argument("--grid-d", type=sizes, default="4,6,8,10,12", help="max depths d of the hindsight grid")
    ap.add_argument("--profile-seconds", type=float, default=120.0, help="the bounded profile's budget")
    ap.add_argument("--dynamic-extend", type=int, default=0, help="also DYNAMIC+EXTEND: the dynamic tree whose "
                    "confident path may grow this many levels beyond the served plan (dynamic_extend)")
    ap.add_argument("--plan-store", help="publish the served plans here (default: a scratch directory); "
                    "benchmarks/load.py --plan-store serves them")
    ap.add_argument("--device", default="auto", choices=DEVICE_CHOICES, help="auto = a GPU if torch sees one")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    args.draft_quantize, args.device = pair_options(args.draft_quantize, args.device)
    args.draft_vocab = None if args.draft_vocab == FULL else args.draft_vocab
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    temperatures = [float(x) for x in args.temperatures.split(",")]

    pair = LocalPair.load(dtype=args.dtype, draft_quantize=args.draft_quantize, device=args.device,
                          draft_vocab=args.draft_vocab)
    print(f"target on {pair.target.model.device}, draft on {pair.draft.model.device}", flush=True)
    by_kind = defaultdict(list)
    for p in load_prompts(HERE / "prompts.jsonl"):
        if len(by_kind[p.kind]) < args.limit:
            by_kind[p.kind].append(pair.encode(p.text, chat=p.chat))
    served, profile = served_plans(pair, args, temperatures)

    rows, record = [], {"args": vars(args) | {"out": str(args.out)}, "results": []}
    for temperature in temperatures:
        result, planned = served[temperature]
        configs = [("target alone", functools.partial(run_ours, pair, chain(0), temperature=temperature,
                                                      max_tokens=args.max_tokens, speculate=False))]
        configs += assisted_configs(pair, temperature, args.max_tokens)
        configs += plan_configs(pair, temperature, result, planned, args, profile)
        rows += run_configs(configs, by_kind, temperature)
        record["results"].append({"temperature": temperature, "served": asdict(result),
                                  "provenance": vars(planned.provenance), "acceptance": planned.acceptance.to_dict()})
    ratios(rows)
    print()
    print_table(rows, ["T", "kind", "config", "tok/s", "x target", "x assisted", "x best fixed", "tok/step", "tokens"])
    summary = summarize(rows, served)
    print()
    print_table(summary, ["T", "kind", "served", "x target", "x assisted", "x best fixed", "best fixed", "predicted"]
                + [f"{name} {col}" for name in VARIANTS for col in ("x target", "x assisted",
                                                                                      "x best fixed")])
    record["rows"], record["summary"] = rows, summary
    write_json("e2e", record, args.out)


def run_configs(configs, by_kind, temperature: float) -> list[dict]:
    """Every config on every prompt, interleaved: prompt by prompt, each config in turn, the order rotated by
    one config per prompt, so a host whose speed drifts over minutes slows every config alike instead of
    whichever ran in its slow phase. A config's figure is its tokens over its seconds summed over its prompts."""
    for _, fn in configs:
        fn([by_kind["code"][0][:8]])  # warm-up: first-call kernel selection is not part of any config's time
    totals = defaultdict(lambda: [0, 0.0, 0])  # (config, kind) -> tokens, seconds, steps
    jobs = [(kind, j, prompt) for kind, ps in by_kind.items() for j, prompt in enumerate(ps)]
    for turn, (kind, j, prompt) in enumerate(jobs):
        for name, fn in configs[turn % len(configs):] + configs[:turn % len(configs)]:
            tokens, seconds, steps = fn([prompt], first_seed=j)
            total = totals[(name, kind)]
            total[0] += tokens
            total[1] += seconds
            total[2] += steps or 0
        print(f"  {temperature} {kind:5s} prompt {j + 1}/{len(by_kind[kind])} done by {len(configs)} configs",
              flush=True)
    rows = []
    for kind in by_kind:
        base = totals[(configs[0][0], kind)]
        for name, _ in configs:
            tokens, seconds, steps = totals[(name, kind)]
            tps = tokens / seconds
            rows.append({"T": temperature, "kind": kind, "config": name, "tok/s": tps,
                         "x target": tps / (base[0] / base[1]), "tok/step": tokens / steps if steps else "-",
                         "tokens": tokens})
            print(f"  {temperature} {kind:5s} {name:28s} {tps:6.2f} tok/s  x{rows[-1]['x target']:.2f}", flush=True)
    return rows


VARIANTS = {  # summary column -> (config name, a tree per request, dynamic rules: None, "prune" or "extend")
    "adaptive": ("ADAPTIVE", True, None), "dynamic": ("DYNAMIC", False, "prune"),
    "both": ("ADAPTIVE+DYNAMIC", True, "prune"), "extend": ("DYNAMIC+EXTEND", False, "extend"),
    "all": ("ADAPTIVE+DYNAMIC+EXTEND", True, "extend")}


def variant(config: str) -> str | None:
    """The summary column of a variant's config name (``DYNAMIC+EXTEND 4 from n=16 d=5`` -> ``extend``)."""
    name = config.split(" from ")[0].rstrip("0123456789 ")
    return next((column for column, (n, _, _) in VARIANTS.items() if n == name and " from " in config), None)


def summarize(rows: list[dict], served) -> list[dict]:
    """Per temperature and kind: the served plan against the target alone, assisted and the best fixed plan,
    and the profile's predicted speedup."""
    out = []
    for (temperature, kind) in sorted({(r["T"], r["kind"]) for r in rows}):
        sub = [r for r in rows if (r["T"], r["kind"]) == (temperature, kind)]
        mine = next(r for r in sub if r["config"].startswith("SERVED"))
        best = max((r for r in sub if r["config"].startswith("grid")), key=lambda r: r["tok/s"])
        row = {"T": temperature, "kind": kind, "served": mine["config"][7:], "x target": mine["x target"],
               "x assisted": mine["x assisted"], "x best fixed": mine["x best fixed"], "best fixed": best["config"][5:],
               "predicted": served[temperature][0].predicted_speedup}
        for name in VARIANTS:
            found = next((r for r in sub if variant(r["config"]) == name), None)
            row |= {f"{name} {col}": found[col] if found else "-" for col in ("x target", "x assisted", "x best fixed")}
        out.append(row)
    return out


if __name__ == "__main__":
    main()
