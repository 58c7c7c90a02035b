"""Prompt files: the profiler's prompts mix their kinds from the first one on (``prompts.interleave_kinds``), and
a line that is not a prompt is an error naming it."""

from __future__ import annotations

import json

import pytest

from sequoia_ray import profiling
from sequoia_ray.config import ProfileJobConfig
from sequoia_ray.prompts import Prompt, interleave_kinds, load_prompts


def test_kinds_taken_in_turn_each_in_its_own_order():
    code = [Prompt(f"c{i}", kind="code") for i in range(3)]
    prose = [Prompt(f"p{i}", kind="prose") for i in range(2)]
    chat = [Prompt("t0", kind="chat")]
    out = interleave_kinds(code + prose + chat)
    assert [p.text for p in out] == ["c0", "p0", "t0", "c1", "p1", "c2"]
    assert interleave_kinds([]) == [] and interleave_kinds(code) == code  # one kind: unchanged


def test_builtin_prompts_alternate_from_the_first():
    """A measured choice at batch 1 runs prompts[0], prompts[1], ... one a round: its first two rounds see
    both kinds (they saw code twice before)."""
    kinds = [p.kind for p in profiling.profile_prompts(ProfileJobConfig(storage="unused"))]
    assert kinds[:2] == ["code", "prose"] and sorted(kinds) == sorted(p.kind for p in profiling.BUILTIN_PROMPTS)
    assert all(a != b for a, b in zip(kinds, kinds[1:]))


def test_max_prompts_keeps_both_kinds_of_a_sorted_file(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"code {i}", "kind": "code"} for i in range(5)] + \
           [{"prompt": f"prose {i}", "kind": "prose"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    kept = profiling.profile_prompts(ProfileJobConfig(storage="unused", prompts=str(path), max_prompts=4))
    assert [p.text for p in kept] == ["code 0", "prose 0", "code 1", "prose 1"]


@pytest.mark.parametrize("line", ['{"prompt": null}', '{"prompt": ["a"]}', '{"prompt": ""}', '{"text": "a"}',
                                  '{"prompt": "a", "chat": "false"}', '{"prompt": "a", "kind": 3}', "[1]"])
def test_a_prompt_line_that_is_not_a_prompt_names_its_line(tmp_path, line):
    """null, a list or "" were read as the text 'None', "['a']" or nothing, and "false" as chat True."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected a JSON object with a non-empty 'prompt' string"):
        load_prompts(path)


def test_a_prompt_file_not_in_utf8_names_itself(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(ValueError, match="p.txt is not UTF-8"):
        load_prompts(path)

