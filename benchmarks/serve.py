"""In-process engine vs Ray Serve (draft and target on separate actors), same prompts, same plan.

    .venv/bin/python benchmarks/serve.py [--tiny] [--limit 4] [--max-tokens 48] [--rounds 1] [--tp-size 1]

Greedy decoding of the same prompts with the built-in plan, in three phases, each interleaved prompt by prompt
(every mode in turn, the order rotated by one mode a prompt: this host's speed moves up to 2x within minutes,
and rows run one after another carried that drift). Before Ray starts: in process, and with the draft and the
target each in a process of its own without Ray (plain pipes, ``benchmarks/processes.py``: what the separation
costs by itself). Then with the local Serve app up: through its HTTP API, in process and in the two processes
again (the app idle beside them: Ray's and Serve's background running as under the Serve row). And in process
with every Ray process paused (SIGSTOP for the run, ``benchmarks/background.py``): the app as if it were not
there, interleaved with the Serve row, so Serve against it is what Serve costs against a clean in-process run
without the drift between phases. Then, Ray stopped, the first phase again. Each row's ratio is to the in-process
row of its phase, so Serve against in-process beside the idle app is what Ray's actors and calls cost, and the
in-process rows beside the app against the mean of those before and after it what the idle app costs.
Prints tokens/s, ms a step and where a step's time goes (the draft's call ``grow`` and the target's ``verify``
per step, as the decoder saw them: with the call's round trip; and the forwards alone: through Serve the model
actors' batches as their traces time them, in process the worker calls), and what a Serve step adds to one in
process beside the idle app, in the forwards and in the calls and the ingress; writes
benchmarks/results/serve.json. The goal is Serve within 10% of in-process.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from background import ray_groups, while_paused  # noqa: E402
from common import print_table, write_json  # noqa: E402
from load import model_actors  # noqa: E402
from processes import apart, interleave, load_pair, pair_args, rows_of, run, warm  # noqa: E402

from sequoia_ray.local import LocalPair  # noqa: E402
from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402

HERE = Path(__file__).resolve().parent


def add_app_args(ap: argparse.ArgumentParser, port: int) -> None:
    """The options ``start_serve`` reads: how the app's actors run, its port, Ray's timers."""
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--num-cpus", type=float, default=1, help="logical CPUs each model actor reserves")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per model actor (in-process: 2 too)")
    ap.add_argument("--port", type=int, default=port)
    ap.add_argument("--ray-default-timers", action="store_true",
                    help="Ray's own idle timers (default: slowed, as the service starts it: actors/quiet_ray.py)")


def start_serve(args):
    """The app on local Ray; a function running one prompt through its HTTP API (a run dict as ``run``'s)."""
    import requests

    from deployments.launch import start

    cfg = {"model_name": "bench", "draft": args.draft, "target": args.target, "dtype": args.dtype,
           "draft_quantize": args.draft_quantize, "tp_size": args.tp_size, "num_cpus": args.num_cpus,
           "threads": args.threads}
    url = start(cfg, args.port, None, quiet=not args.ray_default_timers)
    post = lambda body: requests.post(f"{url}/v1/{'chat/' if 'messages' in body else ''}completions",  # noqa: E731
                                      json={"model": "bench", "temperature": 0, **body}, timeout=900).json()
    post({"prompt": "warm up", "max_tokens": 4})
    actors = list(model_actors().values())

    def one(p) -> dict:
        body = ({"messages": [{"role": "user", "content": p.text}]} if p.chat else {"prompt": p.text})
        since = time.monotonic()  # the actors' clock: one host
        start_t = time.perf_counter()
        out = post({**body, "max_tokens": args.max_tokens})
        seconds = time.perf_counter() - start_t
        spec = out["usage"]["speculative"]
        text = out["choices"][0]["message"]["content"] if p.chat else out["choices"][0]["text"]
        return {"tokens": out["usage"]["completion_tokens"], "seconds": seconds, "steps": spec["steps"],
                "text": text, "draft_s": spec["draft_s"], "verify_s": spec["verify_s"],
                "forward_s": actor_forward_s(actors, since)}
    return one


def actor_forward_s(actors: list, since: float) -> float:
    """Seconds the model actors' batchers spent in batches (forwards) that began at or after ``since``: in a
    Serve step, what is not the actors' calls and the ingress (read after the request, outside its timing)."""
    import ray

    return sum(f.end - f.start for forwards in ray.get([a.batch_trace.remote(since) for a in actors])
               for f in forwards)


def measure(pair: LocalPair, args, prompts) -> tuple[list[dict], dict[str, int]]:
    """Before Ray: in process and in two processes, interleaved. Then with the app up: through Serve, in process and in
    two processes (the app idle beside them), and in process with all of Ray paused, interleaved. Then, Ray
    stopped, the first phase again (before and after bracket the app's phase: a steady drift of the host moves
    their mean as much as the middle phase). Each row's ratio is to the in-process row of its phase. Also how
    many runs gave the in-process text, per mode."""
    import ray
    from ray import serve

    local = pair.decoder(builtin_plan(0.0).plan)
    split, workers = apart(pair, args)
    try:
        warm(local, split, pair=pair)
        here = functools.partial(run, local, pair, max_tokens=args.max_tokens)
        apart_ = functools.partial(run, split, pair, max_tokens=args.max_tokens)
        before = interleave({"in-process": here, "two processes, no Ray": apart_}, prompts, args.rounds)
        try:
            through_serve = start_serve(args)
            every = [p for procs in ray_groups().values() for p in procs]
            beside = interleave({"in-process, Serve app idle beside it": here, "Ray Serve (HTTP)": through_serve,
                                 "two processes, Serve app idle beside them": apart_,
                                 "in-process, all of Ray paused": while_paused(every, here)}, prompts, args.rounds)
        finally:
            serve.shutdown()
            ray.shutdown()
        after = interleave({"in-process, Ray stopped": here, "two processes, Ray stopped": apart_}, prompts,
                           args.rounds)
    finally:
        for w in workers:
            w.close()
    column = "vs in-process, same phase"
    rows = (rows_of(before, "in-process", column) + rows_of(beside, "in-process, Serve app idle beside it", column)
            + rows_of(after, "in-process, Ray stopped", column))
    texts = [r["text"] for r in before["in-process"]]
    same = {name: sum(a == r["text"] for a, r in zip(texts, done))
            for phase in (before, beside, after) for name, done in phase.items()}
    return rows, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models (seconds)")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=1, help="rounds over the prompts per phase")
    add_app_args(ap, port=8011)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pair_args(args)
    prompts = load_prompts(HERE / "prompts.jsonl")[: args.limit]
    rows, same = measure(load_pair(args), args, prompts)
    print_table(rows, ["mode", "tok/s", "step ms", "draft ms", "verify ms", "forwards ms", "tok/step", "tokens",
                       "vs in-process, same phase"])
    runs = args.rounds * len(prompts)
    print("the in-process text in " + ", ".join(f"{n}/{runs} runs {name}" for name, n in same.items()
                                                 if name != "in-process") + f" ({args.dtype})")
    rate = {r["mode"]: r["tok/s"] for r in rows}
    bracket = (rate["in-process"] + rate["in-process, Ray stopped"]) / 2
    print(f"in process: {rate['in-process, Serve app idle beside it'] / bracket:.2f}x with the Serve app idle "
          f"beside it (against the mean of before and after); Ray Serve {rate['Ray Serve (HTTP)'] / bracket:.2f}x "
          "of that mean")
    clean = rate["in-process, all of Ray paused"]
    print(f"within the app's phase: Ray Serve {rate['Ray Serve (HTTP)'] / clean:.2f}x and in process beside the "
          f"idle app {rate['in-process, Serve app idle beside it'] / clean:.2f}x in process with all of Ray paused "
          "(no drift between phases: the goal's measure)")
    row = {r["mode"]: r for r in rows}
    served, here = row["Ray Serve (HTTP)"], row["in-process, Serve app idle beside it"]
    more = served["step ms"] - here["step ms"]
    forwards = served["forwards ms"] - here["forwards ms"]
    print(f"a Serve step took {more:+.1f} ms against in process beside the idle app: {forwards:+.1f} in the actors' "
          f"forwards, {more - forwards:+.1f} in the calls and the ingress")
    write_json("serve", {"rows": rows, "identical": same, "runs": runs,
                         "args": {k: str(v) for k, v in vars(args).items()}}, args.out)


if __name__ == "__main__":
    main()
