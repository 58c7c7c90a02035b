"""The ``sequoia-ray`` command line: plan | measure | profile | generate | serve | bench | models.

Every verb validates its input and exits with code 2 and a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

EXIT_BAD_INPUT = 2


class CLIError(ValueError):
    """Bad command-line input; printed as one line, exit code 2."""


def _depth_arg(text: str) -> int | None:
    if text.lower() in ("unbounded", "none", "inf"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or 'unbounded'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1 (levels, root included)")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="optimal Sequoia tree for an acceptance vector and a node budget")
    p.add_argument("--acceptance", required=True, help="JSON file {'p': [...], 'reject': r} or a list '0.6,0.2,0.1'")
    p.add_argument("--budget", required=True, type=_positive_int, help="tree nodes n, root included")
    p.add_argument("--max-depth", type=_depth_arg, default=None, help="levels d, root included (default unbounded)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="write the plan file (JSON with schema_version) here")
    p.add_argument("--plot", help="draw G(n) per depth, baselines and the tree into this PNG")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from sequoia_ray.tree.acceptance_vector import AcceptanceVector
    from sequoia_ray.tree.planning import plan_for

    acceptance = AcceptanceVector.parse(args.acceptance)
    planned, table = plan_for(acceptance, args.budget, args.max_depth)
    if args.out:
        planned.save(args.out)
    if args.plot:
        from sequoia_ray.tree.plot import plot_plan

        plot_plan(table, planned.plan, args.plot)
    if args.json:
        print(json.dumps(planned.to_dict()))
    else:
        print(_plan_summary(planned))
    return 0


def _plan_summary(planned) -> str:
    plan = planned.plan
    widths = [len(level) for level in plan.levels]
    return (
        f"expected tokens per target call G(n={planned.budget}, d={planned.max_depth or 'unbounded'}) = "
        f"{planned.expected_tokens:.4f}\n"
        f"tree: {plan.n} nodes, {plan.num_levels} levels, nodes per level {widths}\n"
        f"parents: {list(plan.parents)}"
    )


VERBS: list[Callable[[argparse._SubParsersAction], None]] = [_add_plan]


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not a usage dump."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sequoia-ray", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    for add in VERBS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # usage errors and --help
        return int(exc.code or 0)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"sequoia-ray {args.verb}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
