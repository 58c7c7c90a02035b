"""Which of Ray's and Serve's idle processes slow a decoder beside them: pause each group, decode, compare.

    .venv/bin/python benchmarks/background.py [--tiny] [--limit 3] [--max-tokens 48] [--rounds 2]

``benchmarks/serve.py`` measured the in-process decoder ~16% slower beside the idle Serve app than without Ray on
the 2-core Xeon, while the app's ~14 processes used ~13% of one core. This starts the same app, then decodes the
same prompts in process (greedy, the built-in plan) under conditions interleaved prompt by prompt: nothing paused,
every Ray process paused (SIGSTOP, then SIGCONT after the run: the app as if it were not there), and each group of
processes paused alone (GCS, raylet, the agents, the head's daemons, the Serve controller, the proxy, the replicas,
the model actors, idle workers). A group whose pause wins back tokens/s is one whose wake-ups cost; a pause lasts
one generation (seconds), far below Ray's and Serve's health-check timeouts. Prints tokens/s and the ratio to
"nothing paused" (over all runs, and the median and interquartile range of the ratios paired by prompt and round);
writes benchmarks/results/background.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, quartiles, write_json  # noqa: E402
from processes import interleave, load_pair, pair_args, rows_of, run, warm  # noqa: E402

from sequoia_ray.prompts import load_prompts  # noqa: E402
from sequoia_ray.tree.builtin import builtin_plan  # noqa: E402

HERE = Path(__file__).resolve().parent

BINARIES = {"gcs_server": "GCS", "raylet": "raylet"}  # by the executable's name (the raylet's arguments name
# the agents' scripts)
# (group, a substring of the command line), first match wins: Ray's Python processes name themselves in argv
ROLES = (
    ("dashboard agent", "DashboardAgent"),
    ("runtime-env agent", "RuntimeEnvAgent"),
    ("head daemons", "autoscaler/"),  # the autoscaler's monitor, the dashboard head (even without its UI),
    ("head daemons", "dashboard/dashboard.py"),  # the log monitor
    ("head daemons", "log_monitor.py"),
    ("Serve controller", "ServeController"),
    ("proxy", "ProxyActor"),
    ("replicas", "ServeReplica"),
    ("idle workers", "ray::IDLE"),
    ("model actors", "ray::"),  # the rest of ray::<Class> are our actors (draft, target ranks)
)


def role_of(cmdline: Iterable[str]) -> str | None:
    """The group of a Ray process from its command line, None for a process that is not Ray's."""
    cmdline = list(cmdline)
    if cmdline and (binary := BINARIES.get(Path(cmdline[0]).name)):
        return binary
    line = " ".join(cmdline)
    return next((group for group, mark in ROLES if mark in line), None)


def ray_groups(exclude: int = os.getpid()) -> dict[str, list]:
    """psutil processes of this machine's Ray, by group (``exclude``: this driver)."""
    import psutil

    groups: dict[str, list] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.info["pid"] == exclude:
            continue
        group = role_of(proc.info["cmdline"] or [])
        if group:
            groups.setdefault(group, []).append(proc)
    return groups


@contextlib.contextmanager
def paused(procs: list) -> Iterator[None]:
    """``procs`` stopped (SIGSTOP) for the block, resumed after whatever happens."""
    stopped = []
    try:
        for proc in procs:
            proc.suspend()
            stopped.append(proc)
        yield
    finally:
        for proc in stopped:
            with contextlib.suppress(Exception):
                proc.resume()


def while_paused(procs: list, fn):
    """``fn`` with ``procs`` paused for each call."""
    def call(*args):
        with paused(procs):
            return fn(*args)
    return call


def paired(base: list[dict], runs: list[dict]) -> dict:
    """The median and interquartile range over the runs of ``base``'s seconds over ``runs``'s on the same prompt
    and round (the same tokens: the speed ratio; pairs cancel a drift slower than one round of modes)."""
    ratios = sorted(b["seconds"] / r["seconds"] for b, r in zip(base, runs))
    q1, median, q3 = quartiles(ratios, method="inclusive")
    return {"paired median": median, "paired IQR": f"{q1:.2f}-{q3:.2f}"}


def main() -> None:
    from serve import add_app_args, start_serve  # serve.py imports this module's pauses

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random models (seconds)")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    add_app_args(ap, port=8012)
    ap.add_argument("--all-only", action="store_true", help="only nothing paused and all Ray paused")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    pair_args(args)
    prompts = load_prompts(HERE / "prompts.jsonl")[: args.limit]
    pair = load_pair(args)
    local = pair.decoder(builtin_plan(0.0).plan)
    import ray
    from ray import serve
    try:
        start_serve(args)  # the app up and warmed by one request; then idle
        groups = ray_groups()
        warm(local, pair=pair)
        every = [p for procs in groups.values() for p in procs]
        here = functools.partial(run, local, pair, max_tokens=args.max_tokens)
        modes = {"nothing paused": while_paused([], here), "all Ray paused": while_paused(every, here)}
        if not args.all_only:
            modes |= {f"{group} paused": while_paused(procs, here) for group, procs in sorted(groups.items())}
        runs = interleave(modes, prompts, args.rounds)
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = rows_of(runs, "nothing paused")
    for row in rows:
        name = row["mode"].removesuffix(" paused")
        row["processes"] = len(every) if name == "all Ray" else len(groups.get(name, []))
        row |= paired(runs["nothing paused"], runs[row["mode"]])
    print_table(rows, ["mode", "processes", "tok/s", "step ms", "draft ms", "verify ms", "tokens",
                       "vs nothing paused", "paired median", "paired IQR"])
    texts = [r["text"] for r in runs["nothing paused"]]
    same = {name: sum(a == r["text"] for a, r in zip(texts, done)) for name, done in runs.items()}
    print(f"the unpaused text in {min(same.values())}/{len(texts)} runs of every mode")
    write_json("background", {"rows": rows, "identical": same, "runs": len(texts),
                              "seconds": {name: [r["seconds"] for r in done] for name, done in runs.items()},
                              "groups": {g: [p.info["cmdline"][:3] for p in procs] for g, procs in groups.items()},
                              "args": {k: str(v) for k, v in vars(args).items()}}, args.out)


if __name__ == "__main__":
    main()
