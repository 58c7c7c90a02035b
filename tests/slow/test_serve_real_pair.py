"""The real default pair through the HTTP API of a local Serve app (fp32: exact greedy identity)."""

from __future__ import annotations

import socket

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_real_pair_over_http_equals_in_process():
    ray = pytest.importorskip("ray")
    from ray import serve

    from deployments.app import build_app
    from sequoia_ray.config import SamplingParams
    from sequoia_ray.local import LocalPair
    from sequoia_ray.tree.builtin import builtin_plan

    prompt = "def is_even(n):\n    \"\"\"Return True if n is even.\"\"\"\n"
    pair = LocalPair.load(dtype="float32", progress=False)
    expected = pair.decoder(builtin_plan(0.0).plan, speculate=False).generate(
        pair.encode(prompt, chat=False), SamplingParams(max_tokens=16))
    del pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, ignore_reinit_error=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model_name": "real", "dtype": "float32", "num_cpus": 1}), name="real", route_prefix="/")
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600,
                          json={"model": "real", "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == expected.text
        assert body["usage"]["speculative"]["tokens_per_step"] > 1.5
    finally:
        serve.shutdown()
        ray.shutdown()
