"""benchmarks/draft_vocab.py on the tiny pair: the heads really switch, greedy tokens stay the target's under
every head, and a subset that leaves out the target's tokens shows it (fewer tokens a step, a share left out)."""

from __future__ import annotations

import sys
from pathlib import Path

from sequoia_ray.local import LocalPair
from sequoia_ray.models.draft_vocab import SubsetHead
from sequoia_ray.tree.plan import k_ary

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import draft_vocab  # noqa: E402


def test_heads_switch_and_greedy_tokens_are_the_same_under_every_head():
    pair = LocalPair.tiny(device="cpu")
    full = pair.draft.model.get_output_embeddings()
    heads = draft_vocab.heads(pair, [40], tiny=True, quantize=None)
    assert heads["full"] is full and isinstance(heads["40"], SubsetHead) and len(draft_vocab.kept(heads["40"])) == 40
    prompts = {"code": [pair.encode("def f(x):", chat=False), pair.encode("print(", chat=False)]}
    rows, same = draft_vocab.decode(pair, heads, k_ary(2, 3), prompts, [0.0], rounds=1, max_tokens=24)
    assert pair.draft.model.get_output_embeddings() is full  # put back
    assert same == {"code/full": [True, True], "code/40": [True, True]}
    by = {r["head"]: r for r in rows}
    assert by["full"]["left out"] == 0 and by["full"]["time / full"] == 1
    assert by["40"]["left out"] > 0.3 and by["40"]["tok/step"] < by["full"]["tok/step"]


def test_a_level_is_timed_with_the_head_it_has():
    pair = LocalPair.tiny(device="cpu")
    assert draft_vocab.level_ms(pair.draft.model, repeats=3, context=16) > 0
    assert pair.draft.model.get_output_embeddings() is not None
