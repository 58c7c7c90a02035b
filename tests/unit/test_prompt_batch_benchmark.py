"""benchmarks/prompt_batch.py's ways and table, over a fake service (no HTTP): each way sends what it says, the
texts come back in the prompts' order, and the table's ratio and text check are paired by round."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import prompt_batch  # noqa: E402


class Fake:
    """A service whose completion of a prompt is the prompt upper-cased, 3 tokens each; it records what it got."""

    def __init__(self) -> None:
        self.sent, self.lock = [], threading.Lock()

    def __call__(self, prompt):
        with self.lock:
            self.sent.append(prompt)
        batch = prompt if isinstance(prompt, list) else [prompt]
        choices = [{"index": i, "text": p.upper()} for i, p in reversed(list(enumerate(batch)))]  # any order
        return {"choices": choices, "usage": {"completion_tokens": 3 * len(batch)}}


@pytest.mark.parametrize("way, requests", [("one by one", 3), ("one batch request", 1), ("concurrent requests", 3)])
def test_each_way_sends_its_requests_and_reads_the_texts_in_the_prompts_order(way, requests):
    fake = Fake()
    out = prompt_batch.run_way(way, fake, ["a", "b", "c"])
    assert out["texts"] == ["A", "B", "C"] and out["tokens"] == 9 and len(fake.sent) == requests
    assert out["tok_s"] == pytest.approx(9 / out["wall_s"])


def test_the_table_pairs_rounds_and_counts_rounds_with_the_same_texts():
    def run(tok_s, texts):
        return {"wall_s": 1.0, "tokens": 10, "tok_s": tok_s, "texts": texts}

    runs = {"one by one": [run(2.0, ["x"]), run(4.0, ["x"])],
            "one batch request": [run(4.0, ["x"]), run(6.0, ["y"])],
            "concurrent requests": [run(3.0, ["x"]), run(4.0, ["x"])]}
    rows = {r["way"]: r for r in prompt_batch.compare(runs)}
    assert rows["one batch request"]["x one by one"] == pytest.approx((2.0 + 1.5) / 2)  # per round, then median
    assert rows["one batch request"]["same texts"] == "1/2" and rows["concurrent requests"]["same texts"] == "2/2"


def test_prompts_are_spread_over_the_file_and_a_count_out_of_range_is_refused():
    assert prompt_batch.spread(list(range(10)), 4) == [0, 2, 5, 7]
    with pytest.raises(ValueError, match="--prompts 11"):
        prompt_batch.spread(list(range(10)), 11)
