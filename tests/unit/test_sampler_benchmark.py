"""benchmarks/sampler.py on the tiny pair: each sampler really serves its runs (the verifier's draws and
verify_node's), the module's sampler is put back, and the micro timing reports both."""

from __future__ import annotations

import sys
from pathlib import Path

from sequoia_ray import sampling, verify
from sequoia_ray.local import LocalPair
from sequoia_ray.lockstep import ROOT_ONLY
from sequoia_ray.tree.plan import k_ary

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sampler  # noqa: E402


def test_each_sampler_serves_its_own_runs_and_is_put_back(monkeypatch):
    calls = {name: 0 for name in sampler.SAMPLERS}

    def counting(name, fn):
        def wrapped(probs, generator):
            calls[name] += 1
            return fn(probs, generator)
        return wrapped

    monkeypatch.setattr(sampler, "SAMPLERS", {n: counting(n, f) for n, f in sampler.SAMPLERS.items()})
    before = (sampling.sample, verify.sample)
    pair = LocalPair.tiny(device="cpu")
    prompts = [pair.encode("def f(x):", chat=False), pair.encode("Once upon", chat=False)]
    rows = sampler.decode(pair, {"alone": ROOT_ONLY, "tree": k_ary(2, 2)}, [1, 2], rounds=1, max_tokens=6,
                          prompts=prompts)
    assert (sampling.sample, verify.sample) == before
    assert calls["inverse_cdf"] > 0 and calls["multinomial"] > 0
    assert {(r["B"], r["plan"], r["sampler"]) for r in rows} == {
        (b, p, s) for b in (1, 2) for p in ("alone", "tree") for s in ("inverse_cdf", "multinomial")}
    assert all(r["tok/s"] > 0 for r in rows)
    assert all(r["time / multinomial"] == 1 for r in rows if r["sampler"] == "multinomial")


def test_one_draw_is_timed_for_both_samplers():
    assert set(sampler.draw_us(5000, draws=5)) == {"inverse_cdf", "multinomial"}
