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



def test_a_prompt_line_ends_at_a_newline_only(tmp_path):
    """``splitlines`` also split at U+2028, U+0085 and form feeds: JSON writes U+2028 raw inside a string
    (``ensure_ascii=False``), so a valid .jsonl line failed as an unterminated string, and a .txt prompt holding a
    form feed was read as two prompts."""
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "first clause\u2028second", "kind": "prose"}, {"prompt": "caf\u00e9\x85culture\x0cpage"}]
    path.write_bytes("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode())
    assert [(p.text, p.kind) for p in load_prompts(path)] == [("first clause\u2028second", "prose"),
                                                                ("caf\u00e9\x85culture\x0cpage", "text")]
    path = tmp_path / "p.txt"
    path.write_bytes("def f():\n    pass\x0c page two\r\nSummarise caf\u00e9\x85cul\rture\u2028too\n".encode())
    assert [p.text for p in load_prompts(path)] == ["def f():", "    pass\x0c page two",
                                                    "Summarise caf\u00e9\x85cul\rture\u2028too"]


def test_a_utf8_bom_is_not_part_of_the_first_prompt(tmp_path):
    """Windows editors begin UTF-8 files with a BOM: it was read as the first prompt's first character, and the
    first .jsonl line failed to parse."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "b"}\n')
    assert [p.text for p in load_prompts(path)] == ["a", "b"]
    path = tmp_path / "p.txt"
    path.write_bytes(b"\xef\xbb\xbfHello\n")
    assert [p.text for p in load_prompts(path)] == ["Hello"]
    path.write_bytes(b"\xef\xbb\xbfcaf\xe9\n")  # the byte counted in the file, BOM included
    with pytest.raises(ValueError, match=r"p.txt is not UTF-8 text \(byte 6\)"):
        load_prompts(path)


def test_an_error_names_its_physical_line_after_blank_lines(tmp_path):
    """Lines were numbered after the blank ones were dropped: the bad object on line 4 was reported as line 2."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n  \n{"prompt": "b", "chat": "yes"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:4: expected a JSON object"):
        load_prompts(path)
