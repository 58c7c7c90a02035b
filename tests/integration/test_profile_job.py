"""The profiling job's parts: hardware discovery and bundles, argument errors, the in-process verb, and a
tensor-parallel trial on the session's Ray (`ray job submit` end to end: test_job_submit.py)."""

from __future__ import annotations

import json

import pytest

from cli.main import main as cli_main
from sequoia_ray.hardware import BATCH_BUCKETS
from sequoia_ray.plan_store import PlanKey, PlanStore
from tests.serving import session_ray
from tuning.profile import discover_hardware, main as job_main, parse_config, trial_bundles


def test_discover_and_bundles():
    assert discover_hardware({"CPU": 8, "accelerator_type:A100": 2, "accelerator_type:L4": 1}) == ["A100", "L4"]
    assert discover_hardware({"CPU": 2}) == ["cpu"]
    assert trial_bundles("A100", 2, 1) == [{"CPU": 1, "GPU": 1, "accelerator_type:A100": 0.001}] * 3
    assert trial_bundles("L4", 1, 2) == [{"CPU": 2, "GPU": 1, "accelerator_type:L4": 0.001}]
    assert trial_bundles("cpu", 1, 2) == [{"CPU": 2}]
    assert trial_bundles("cpu", 2, 1) == [{"CPU": 1}] * 3


@pytest.mark.parametrize(
    "args,needle",
    [(["--smoke-test"], "--storage"), (["--storage", "x", "--temperatures", "a,b"], "comma-separated numbers"),
     (["--storage", "x", "--budgets", "0,4"], "budgets"), (["--storage", "x", "--acceptance", "nofile"], "T=FILE"),
     (["--storage", "x", "--cpus-per-trial", "0"], "must be > 0"),
     (["--storage", "x", "--budgets", "4,inf"], "finite"),
     (["--storage", "x", "--budgets", "4,5000"], "from 1 to 1024"), (["--storage", "x", "--temperatures", "0,nan"], "finite")],
)
def test_job_bad_arguments_exit_2(args, needle, capsys):
    assert job_main(args) == 2
    assert needle in capsys.readouterr().err


def test_local_paths_reach_the_trials_absolute(tmp_path, monkeypatch):
    """Tune runs each trial in a directory of its own: a relative store, prompt or acceptance path must not be
    read there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.json").write_text(json.dumps({"p": [0.6, 0.2]}))  # read (checked) up front
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a prompt"}) + "\n")  # so is the prompt file
    cfg, _ = parse_config(["--storage", "plans", "--prompts", "p.jsonl", "--acceptance", "0=acc.json"])
    assert (cfg.storage, cfg.prompts) == (str(tmp_path / "plans"), str(tmp_path / "p.jsonl"))
    assert cfg.acceptance == {0.0: str(tmp_path / "acc.json")}
    assert parse_config(["--storage", "s3://bucket/plans?region=x"])[0].storage == "s3://bucket/plans?region=x"


def test_profile_verb_in_process(tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    published, publish = [], PlanStore.publish_plan

    def recording(self, planned, key):
        published.append(key.batch)
        return publish(self, planned, key)

    monkeypatch.setattr(PlanStore, "publish_plan", recording)
    assert cli_main(["profile", "--smoke-test", "--storage", str(store), "--temperatures", "0"]) == 0
    assert published == sorted(BATCH_BUCKETS, reverse=True)  # batch 1 last: its plan marks the set complete
    out = capsys.readouterr().out
    assert "pred" in out and "heatmap" in out
    from sequoia_ray.hardware import SERVED_THREADS, hardware_id

    hw = hardware_id(threads=SERVED_THREADS)  # the verb's default on CPU: the shipped config's threads
    assert f"plans filed under hardware id {hw}" in out
    planned, _ = PlanStore(str(store)).fetch_plan(PlanKey(hw, "tiny-draft", "tiny-target", 0.0))
    assert planned.plan.n <= planned.budget
    assert list((store / "reports").glob("heatmap-*.png"))
    prof = PlanStore(str(store)).fetch_profile(hw)
    assert set(prof.batch_t) == set(prof.batch_c) == set(BATCH_BUCKETS[1:])  # the in-process target: timed
    rows = [line.split() for line in out.splitlines() if line.startswith(hw)]
    assert [int(r[2]) for r in rows] == list(BATCH_BUCKETS)  # a table row per bucket
    for batch, row in zip(BATCH_BUCKETS, rows):
        planned, _ = PlanStore(str(store)).fetch_plan(PlanKey(hw, "tiny-draft", "tiny-target", 0.0, batch))
        assert (planned.budget, planned.provenance.batch) == (int(row[3]), None if batch == 1 else batch)


@pytest.mark.integration
def test_tensor_parallel_trial_times_the_whole_group(tmp_path):
    """A tp_size = 2 trial (gloo on CPU): the target runs as two rank actors; t(n) is the group's."""
    import ray

    from sequoia_ray.config import ProfileJobConfig
    from sequoia_ray.profiling import run_trial
    from tuning.tp_pair import GroupPair

    cfg = ProfileJobConfig(storage=str(tmp_path / "store"), smoke_test=True, tp_size=2, temperatures=(0.0,))
    session_ray()
    pair = GroupPair(cfg, backend="gloo", num_cpus=1, num_gpus=0)
    try:
        results, _ = run_trial(cfg, "cpu-test-tp2", progress=False, pair=pair)
        assert ray.get([r.active.remote() for r in pair.group.ranks]) == [0, 0]  # every request freed
    finally:
        pair.close()
    store = PlanStore(str(tmp_path / "store"))
    assert store.fetch_profile("cpu-test-tp2").t[1] == 1.0
    assert store.fetch_profile("cpu-test-tp2").batch_t == {}  # rank actors: the buckets are extrapolated
    assert [r.batch for r in results] == list(BATCH_BUCKETS)
    store.fetch_plan(PlanKey("cpu-test-tp2", "tiny-draft", "tiny-target", 0.0, 16))
    planned, _ = store.fetch_plan(PlanKey("cpu-test-tp2", "tiny-draft", "tiny-target", 0.0))
    assert results[0].measured_tokens_per_step >= 1.0 and planned.budget == results[0].n >= planned.plan.n


def test_a_store_that_cannot_be_opened_is_an_error_line(capsys):
    assert cli_main(["profile", "--smoke-test", "--storage", "bogus://x", "--temperatures", "0"]) == 2
    err = capsys.readouterr().err
    assert "sequoia-ray profile: error: cannot open plan store 'bogus://x'" in err and "Traceback" not in err


def test_the_in_process_profile_refuses_a_tensor_parallel_size(capsys):
    """It loads one unsharded target: published under a -tp2 hardware id, its costs would describe no TP group."""
    assert cli_main(["profile", "--smoke-test", "--storage", "x", "--tp-size", "2"]) == 2
    assert "python tuning/profile.py --tp-size 2" in capsys.readouterr().err
