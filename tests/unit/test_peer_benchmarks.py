"""The served-peer pieces of the load benchmark: the stream parser takes vLLM's stream shape as well as ours,
the vLLM server's command and settings, its Prometheus counters, and the ratio over vLLM's best setting.
(The servers themselves are started by the benchmark, not here: vLLM takes minutes to start on CPU.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from load import read_stream  # noqa: E402
from load_sweep import ratios  # noqa: E402
from vllm_server import parse_settings, parse_spec_counters, server_command, tokens_per_step  # noqa: E402


def _events(*events) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() for e in events] + [b"", b"data: [DONE]"]


def test_read_stream_takes_vllm_usage_only_last_event():
    lines = _events({"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": None},
                    {"choices": [{"delta": {"content": "Hel"}}], "usage": None},
                    {"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}], "usage": None},
                    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    result = read_stream(lines, 3, 0.0)
    assert result.ok, result.error
    assert (result.prompt, result.text, result.tokens, result.tokens_per_step) == (3, "Hello", 2, None)
    assert result.ttft is not None


def test_read_stream_takes_ours_usage_on_the_last_text_event():
    lines = _events({"choices": [{"text": "a"}]},
                    {"choices": [{"text": "b"}], "usage": {"completion_tokens": 2, "speculative": {"tokens_per_step": 1.5}}})
    result = read_stream(lines, 0, 0.0)
    assert (result.ok, result.text, result.tokens, result.tokens_per_step) == (True, "ab", 2, 1.5)


def test_read_stream_without_usage_is_an_error():
    result = read_stream(_events({"choices": [{"text": "a"}], "usage": None}), 0, 0.0)
    assert not result.ok and "usage" in result.error


def test_settings_parse_and_name_a_bad_one():
    assert parse_settings("plain, k3,k5") == ["plain", "k3", "k5"]
    for bad in ("", "k0", "draft3", "plain,kx"):
        with pytest.raises(ValueError, match="'plain' or kK"):
            parse_settings(bad)


def test_server_command_speculates_only_with_k():
    plain = server_command(Path("/v/bin/python"), "plain", 8123, model_name="bench", target=Path("/t"), draft=Path("/d"))
    assert plain[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--speculative-config" not in plain and "--no-enable-prefix-caching" in plain
    assert plain[plain.index("--port") + 1] == "8123" and plain[plain.index("--served-model-name") + 1] == "bench"
    k3 = server_command(Path("/v/bin/python"), "k3", 8123, model_name="bench", target=Path("/t"), draft=Path("/d"))
    spec = json.loads(k3[k3.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}
    cached = server_command(Path("/v/bin/python"), "plain", 8123, model_name="bench", prefix_caching=True)
    assert "--enable-prefix-caching" in cached and "--no-enable-prefix-caching" not in cached


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="bench"} 40.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="bench"} 1.7956517419757705e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="bench"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="bench"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="bench",position="0"} 30.0
vllm:num_requests_running{engine="0",model_name="bench"} 0.0
"""


def test_spec_counters_and_tokens_per_step():
    after = parse_spec_counters(METRICS)
    assert after["drafts"] == 40 and after["draft_tokens"] == 120 and after["accepted_tokens"] == 70
    assert set(after) == {"drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"}
    before = {"drafts": 20.0, "accepted_tokens": 30.0}
    assert tokens_per_step(before, after) == pytest.approx(1 + 40 / 20)
    assert tokens_per_step({}, parse_spec_counters("vllm:num_requests_running 0.0\n")) is None


def test_ratio_over_the_best_vllm_setting_per_client_count():
    rows = [{"mode": "a", "clients": 8, "tokens/s": 40.0}, {"mode": "c", "clients": 8, "tokens/s": 44.0},
            {"mode": "vLLM plain", "clients": 8, "tokens/s": 50.0}, {"mode": "vLLM k3", "clients": 8, "tokens/s": 40.0},
            {"mode": "c", "clients": 1, "tokens/s": 12.0}, {"mode": "d", "clients": 1, "tokens/s": 15.0}]
    by = {r["clients"]: r for r in ratios(rows)}
    assert by[8]["(c)/vLLM best"] == pytest.approx(44 / 50) and by[8]["(c)/(a)"] == pytest.approx(1.1)
    assert by[1]["(d)/(c)"] == pytest.approx(1.25) and by[8]["(d)/(c)"] is None
    assert by[1]["(c)/vLLM best"] is None and by[1]["(c)/(a)"] is None


def test_rounds_give_the_median_of_each_rounds_ratio():
    """Rounds of (a) and (c) pair by round: the host's drift between rounds cancels in each round's ratio. The
    median of 1.2, 0.5 (an outlier round) and 1.1 is 1.1; the ratio of the modes' medians would be 1.0."""
    cells = {0: (10.0, 12.0), 1: (20.0, 10.0), 2: (15.0, 16.5)}  # round -> (a, c) tokens/s
    rows = [{"mode": m, "clients": 2, "tokens/s": v, "round": i} for i, ac in cells.items() for m, v in zip("ac", ac)]
    rows.append({"mode": "b", "clients": 2, "tokens/s": 6.0})  # (b) runs once: against (c)'s median cell
    (out,) = ratios(rows)
    assert out["(c)/(a)"] == pytest.approx(1.1) and out["(c)/(a) rounds"] == [1.2, 0.5, 1.1]
    assert out["(c)/(b)"] == pytest.approx(12.0 / 6.0)


def test_peer_limit_0_reaches_the_child_as_all_prompts():
    """``--limit 0`` (all prompts) is forwarded as such; before, the child ran its own default of 8."""
    import vllm_peer

    parent = vllm_peer.parse_args(["--limit", "0"])
    child = vllm_peer.parse_args(["--one", "plain", "--child-out", "/tmp/x", *vllm_peer.forwarded(parent)])
    assert child.limit == 0
    everything = vllm_peer.load_prompts(vllm_peer.HERE / "prompts.jsonl", None)
    assert len(vllm_peer.load_prompts(Path(child.prompts), child.limit)) == len(everything) > 8


def _vllm_completion(ids, finish_reason, stop_reason=None):
    from types import SimpleNamespace

    return SimpleNamespace(outputs=[SimpleNamespace(text="ab", token_ids=ids, finish_reason=finish_reason,
                                                    stop_reason=stop_reason)], metrics=None)


def test_vllm_tokens_are_counted_without_the_eos_as_ours_are():
    """vLLM's token_ids end with the EOS (or stop token id) it stopped on; ours stop before it. A stop string
    or the length limit keeps every token on both sides."""
    from vllm_peer import request_row

    assert request_row(_vllm_completion([5, 6, 151645], "stop"))["tokens"] == 2  # EOS: stop_reason None
    assert request_row(_vllm_completion([5, 6, 151643], "stop", 151643))["tokens"] == 2  # a stop token id
    assert request_row(_vllm_completion([5, 6, 7], "stop", "END"))["tokens"] == 3  # a stop string
    assert request_row(_vllm_completion([5, 6, 7], "length"))["tokens"] == 3
    assert request_row(_vllm_completion([], "stop"))["tokens"] == 0


def test_vllm_servers_usage_is_counted_without_the_eos(monkeypatch):
    """Through the server: usage.completion_tokens counts the EOS (one token per request here); the sweep's
    vLLM rows count as ours, so tokens/s compares like with like."""
    import load_sweep

    eos = _events({"choices": [{"text": "ab", "finish_reason": None}]},
                  {"choices": [{"text": "", "finish_reason": "stop", "stop_reason": None}]},
                  {"choices": [], "usage": {"completion_tokens": 3}})
    capped = _events({"choices": [{"text": "abc", "finish_reason": "length", "stop_reason": None}]},
                     {"choices": [], "usage": {"completion_tokens": 3}})
    results = [read_stream(eos, 0, 0.0), read_stream(capped, 0, 0.0)]
    assert [(r.finish_reason, r.stop_reason, r.tokens) for r in results] == [("stop", None, 3), ("length", None, 3)]
    monkeypatch.setattr(load_sweep, "spec_counters", lambda url: {})
    monkeypatch.setattr(load_sweep, "tokens_per_step", lambda before, after: None)
    monkeypatch.setattr(load_sweep, "run_clients", lambda *a, **kw: (results, 1.0))
    row = load_sweep.vllm_point("http://vllm", [], ["ab"], "plain", 2, 1.0, 3, 10.0)
    assert row["tokens/s"] == 2 + 3 and row["completed"] == 2


def test_vllm_is_compared_only_with_the_pair_and_dtype_it_serves():
    """vLLM's server always runs the default pair in bfloat16: `--modes a,c --vllm plain` on the tiny float32
    pair (load.py's default) set the two engines' cells side by side on different models."""
    from load import REAL, TINY, vllm_differs

    assert vllm_differs(REAL) is None
    assert vllm_differs(TINY) == "our target is 'tiny-target'"
    assert vllm_differs({**REAL, "dtype": "float32"}) == "our dtype is 'float32'"
    assert vllm_differs({**REAL, "draft": "/models/other-draft"}) == "our draft is '/models/other-draft'"
    assert vllm_differs({"model_name": "m"}) is None  # a config leaving them out serves the defaults


def test_pooled_tokens_per_step_weighs_streams_by_their_steps():
    from load import Result, pooled_tokens_per_step

    ok = [Result(0, True, 1.0, tokens=40, tokens_per_step=4.0), Result(1, True, 1.0, tokens=2, tokens_per_step=1.0)]
    assert pooled_tokens_per_step(ok) == 42 / 12  # the mean of the streams' own: 2.5
    assert pooled_tokens_per_step([Result(0, True, 1.0)]) is None


def test_a_dead_actor_after_a_cell_fails_the_sweep():
    from load_sweep import held_after

    assert held_after({"TargetRank 0": 0, "DraftActor": "dead"}) == "dead"  # read 0 before: passed
    assert held_after({"TargetRank 0": 2, "DraftActor": 1}) == 3


def test_the_json_keeps_vllms_version_and_commands(tmp_path):
    from vllm_server import provenance

    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 0.32.0\n")
    python.chmod(0o755)
    got = provenance(python, ["plain", "k3"], prefix_caching=True)
    assert got["version"] == "0.32.0" and got["options"] == {"prefix_caching": "True"}
    assert "--enable-prefix-caching" in got["commands"]["plain"] and "--speculative-config" in got["commands"]["k3"]
    assert provenance(tmp_path / "missing", ["plain"])["version"] is None


def test_clients_take_the_temperatures_in_turn_and_only_greedy_texts_are_compared(monkeypatch):
    import load
    from load import Result

    asked = {}

    def client(url, prompts, first, deadline, max_tokens, timeout, **extra):
        asked[first] = extra
        return [Result(first, True, 0.1, text="x", temperature=extra["temperature"])]

    monkeypatch.setattr(load, "client", client)
    results, _ = load.run_clients("u", [], 4, 0.0, 8, 1.0, (0.0, 0.6), speculative=True)
    assert asked[0] == {"temperature": 0.0, "speculative": True}
    assert asked[1] == {"temperature": 0.6, "seed": 1, "speculative": True}  # a sampled client's own seed
    assert asked[3]["temperature"] == 0.6 and asked[2]["temperature"] == 0.0
    refs = ["y"] * 4
    assert [r.differs(refs) for r in sorted(results, key=lambda r: r.prompt)] == [True, False, True, False]
