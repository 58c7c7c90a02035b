"""The real default pair through the HTTP API of a local Serve app (fp32: exact greedy identity): tree
speculation gives the target alone's text, served by the same app (``"speculative": false``); in-process
equality is tested with the real pair in test_real_pair.py and through Serve with the tiny pair."""

from __future__ import annotations

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_real_pair_over_http_equals_the_target_alone():
    pytest.importorskip("ray")
    from tests.serving import serving

    prompt = "def is_even(n):\n    \"\"\"Return True if n is even.\"\"\"\n"
    with serving({"real": {"model_name": "real", "dtype": "float32", "num_cpus": 1}}) as url:
        out = {}
        for name, extra in (("alone", {"speculative": False}), ("tree", {})):
            r = requests.post(f"{url}/real/v1/completions", timeout=600,
                              json={"model": "real", "prompt": prompt, "max_tokens": 16, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            out[name] = r.json()
    assert out["tree"]["choices"][0]["text"] == out["alone"]["choices"][0]["text"]
    assert out["tree"]["usage"]["completion_tokens"] == out["alone"]["usage"]["completion_tokens"]
    assert out["tree"]["usage"]["speculative"]["tokens_per_step"] > 1.5
