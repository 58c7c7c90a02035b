"""The text of a streamed answer, token by token: ``StopChecker``'s incremental decode against decoding the whole
output again at every token (what it did before session 59).

    .venv/bin/python benchmarks/stop_text.py [--lengths 512,1024,2048,4096,8192] [--rounds 3] [--stop S] [--tiny]

The output is the tokens of this repository's README (prose, code and tables) repeated to each length, after a
chat prompt's last tokens, fed one token a step (a chain's step; a tree's step feeds its accepted tokens one by
one the same way). Per length: the milliseconds each way spends over the whole answer and on its last 64 tokens
(the medians of ``--rounds``, the two ways alternated round by round), their ratio, and whether both streamed the
same text (they must). ``--tiny`` uses the tiny character tokenizer (seconds, for the test) instead of the default
target's. Prints a table and writes ``benchmarks/results/stop_text.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_json  # noqa: E402

from sequoia_ray.stopping import DECODE, StopChecker  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
LAST = 64  # the answer's last tokens, timed apart: what a token costs at that length


class WholeDecode(StopChecker):
    """The decode before session 59: the whole output after the prompt's window, again at every token."""

    def _decode(self) -> str:
        if self.prefix:
            text = self.tokenizer.decode(self.prefix + self.ids, **DECODE)
            if text.startswith(self.prefix_text):
                return text[len(self.prefix_text):]
        return self.tokenizer.decode(self.ids, **DECODE)


def stream(kind: type[StopChecker], tokenizer, prompt: list[int], ids: list[int], stop: tuple[str, ...]
           ) -> tuple[str, float, float]:
    """(streamed text, seconds over the whole answer, seconds over its last LAST tokens)."""
    checker, text = kind(tokenizer, stop, frozenset(), prefix=tuple(prompt)), []
    start = time.perf_counter()
    for i, token in enumerate(ids):
        if i == len(ids) - LAST:
            last_start = time.perf_counter()
        text.append(checker.feed([token], len(ids) + 1)[1])
    end = time.perf_counter()
    return "".join(text) + checker._delta(final=True), end - start, end - last_start


def tokens(tokenizer, length: int) -> tuple[list[int], list[int]]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Explain this project."}],
                                         add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    text = tokenizer.encode(README.read_text(), add_special_tokens=False)
    return prompt, (text * (length // len(text) + 1))[:length]


def measure(tokenizer, lengths: list[int], rounds: int, stop: tuple[str, ...]) -> list[dict]:
    rows = []
    for length in lengths:
        prompt, ids = tokens(tokenizer, length)
        runs: dict[str, list[tuple[str, float, float]]] = {"whole": [], "incremental": []}
        for r in range(rounds):
            for kind in ([WholeDecode, StopChecker] if r % 2 == 0 else [StopChecker, WholeDecode]):
                runs["whole" if kind is WholeDecode else "incremental"].append(
                    stream(kind, tokenizer, prompt, ids, stop))
        row = {"tokens": length}
        for name, done in runs.items():
            row[f"{name}_ms"] = 1e3 * statistics.median(d[1] for d in done)
            row[f"{name}_last_us_tok"] = 1e6 * statistics.median(d[2] for d in done) / LAST
        row["speedup"] = row["whole_ms"] / row["incremental_ms"]
        row["same_text"] = all(d[0] == runs["whole"][0][0] for d in runs["whole"] + runs["incremental"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,1024,2048,4096,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable); none by default")
    parser.add_argument("--tiny", action="store_true", help="the tiny character tokenizer (for the test)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if min(lengths) <= LAST or args.rounds < 1:
        parser.error(f"--lengths must each exceed {LAST} and --rounds be ≥ 1 (got {args.lengths}, {args.rounds})")
    if args.tiny:
        from sequoia_ray.models.tiny import char_tokenizer
        tokenizer, source = char_tokenizer(), "tiny character tokenizer"
    else:
        from sequoia_ray.models.loading import DEFAULT_TARGET, load_tokenizer
        tokenizer, source = load_tokenizer(DEFAULT_TARGET), DEFAULT_TARGET
    rows = measure(tokenizer, lengths, args.rounds, tuple(args.stop))
    print(f"{source}; {args.rounds} rounds; stop {args.stop}")
    print_table(rows, list(rows[0]))
    write_json("stop_text", {"tokenizer": source, "rounds": args.rounds, "stop": args.stop, "rows": rows}, args.out)
    return 0 if all(r["same_text"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
