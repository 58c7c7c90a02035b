"""tuning/profile.py's command line (local paths made absolute for the trials, URIs and number lists kept) and its
driver on a stubbed Ray (hardware no node has refused up front, a failed trial reported beside the others)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sequoia_ray.arguments import EXIT_BAD_INPUT
from tuning.profile import (EXIT_TRIAL_FAILED, MissingHardware, check_hardware, join_uri, main, parse_config,
                            root_cause)


def test_a_uri_with_any_scheme_is_kept_and_a_relative_path_made_absolute(tmp_path, monkeypatch):
    """``file:/abs/path`` has no '://', and was resolved as a relative path under the working directory."""
    monkeypatch.chdir(tmp_path)
    assert join_uri(f"file:{tmp_path}/store", "tune") == f"file:{tmp_path}/store/tune"
    assert join_uri("s3://b/p?endpoint_override=h:1", "tune") == "s3://b/p/tune?endpoint_override=h:1"
    assert join_uri("plans", "tune") == f"{tmp_path}/plans/tune"
    assert join_uri("plans?v2/", "tune") == f"{tmp_path}/plans?v2/tune"  # a local folder's name, not a query
    cfg, _ = parse_config(["--storage", f"file:{tmp_path}/store", "--prompts", "file:/data/prompts.jsonl"])
    assert cfg.storage == f"file:{tmp_path}/store" and cfg.prompts == "file:/data/prompts.jsonl"


def test_an_acceptance_number_list_is_kept_and_a_file_made_absolute(tmp_path, monkeypatch):
    """``--acceptance 0=0.8,0.1`` (``AcceptanceVector.parse`` reads number lists) became the path
    ``/cwd/0.8,0.1``, which every trial then failed to read after loading its models."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.json").write_text('{"p": [0.6, 0.2]}')
    cfg, _ = parse_config(["--storage", str(tmp_path), "--acceptance", "0=0.8,0.1", "--acceptance", "0.6=acc.json"])
    assert cfg.acceptance == {0.0: "0.8,0.1", 0.6: str(tmp_path / "acc.json")}


@pytest.mark.parametrize("value, needle", [("0.8,0.7", "sum of p is 1.5"), ("missing.json", "does not exist"),
                                           ("nothing", "neither a JSON file nor")])
def test_a_bad_acceptance_value_fails_the_command(tmp_path, monkeypatch, value, needle):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"--acceptance 0.0={value}: .*{needle}"):
        parse_config(["--storage", str(tmp_path), "--acceptance", f"0={value}"])


def test_relative_model_paths_are_made_absolute_and_registry_names_and_hub_ids_kept(tmp_path, monkeypatch):
    """``--draft ./relmodel`` named nothing in the trial's own directory (``absolute_paths`` covered the store,
    prompts and acceptance files only), and ``relmodel`` was taken there for a hub id. A folder named like a
    registry name stays the name (``resolve`` reads names first)."""
    monkeypatch.chdir(tmp_path)
    for folder in ("relmodel", "default-draft", "models/t"):
        (tmp_path / folder).mkdir(parents=True)
    argv = ["--storage", "s", "--draft", "./relmodel", "--target", "models/t/"]
    cfg, _ = parse_config(argv)
    assert (cfg.draft, cfg.target) == (str(tmp_path / "relmodel"), str(tmp_path / "models/t"))
    cfg, _ = parse_config(["--storage", "s", "--draft", "relmodel", "--target", "./missing.gguf"])
    assert (cfg.draft, cfg.target) == (str(tmp_path / "relmodel"), str(tmp_path / "missing.gguf"))
    cfg, _ = parse_config(["--storage", "s", "--draft", "default-draft", "--target", "Qwen/Qwen2.5-0.5B"])
    assert (cfg.draft, cfg.target) == ("default-draft", "Qwen/Qwen2.5-0.5B")


def test_cpu_trials_measure_and_publish_under_the_id_the_shipped_serve_config_looks_up(tmp_path, monkeypatch):
    """A CPU-only cluster's trial reserved 1 CPU, so profiled at 1 torch thread and filed its plans under
    ``...-1c``, where ``deployments/config.yaml`` (the target's ``threads: 2``) looks them up under ``...-2c``."""
    from deployments.config import ServeConfig
    from deployments.launch import DEFAULT_CONFIG, app_args, serving_hardware_id

    _, options = parse_config(["--storage", str(tmp_path)])
    assert (options.threads, options.cpus) == (2, 2.0)
    seen = run_trainable(monkeypatch, tmp_path, "cpu", "cpu", options.threads)
    assert seen == [(serving_hardware_id(ServeConfig.model_validate(app_args(DEFAULT_CONFIG, []))), 2)]
    _, options = parse_config(["--storage", str(tmp_path), "--threads", "3"])
    assert (options.threads, options.cpus) == (3, 3.0)  # the trial reserves the CPUs it runs on
    _, options = parse_config(["--storage", str(tmp_path), "--threads", "3", "--cpus-per-trial", "1"])
    assert (options.threads, options.cpus) == (3, 1.0)


@pytest.mark.parametrize("device, expected", [("cpu", None), ("cuda", "A100")])
def test_a_trial_publishes_under_the_id_of_what_it_measured(tmp_path, monkeypatch, device, expected):
    """``--device cpu`` on an A100 node measured the node's CPU but filed the plans under ``A100``, where a GPU
    server would serve them; they go under the CPU's id, as serving names CPU actors on a GPU node."""
    from sequoia_ray.hardware import hardware_id

    seen = run_trainable(monkeypatch, tmp_path, "A100", device, 2)
    assert seen == [(expected or hardware_id(None, 1, 2), 2)]


def run_trainable(monkeypatch, tmp_path, hw: str, device: str, threads: int) -> list[tuple[str, int]]:
    """``trainable`` for a trial of type ``hw`` whose models run on ``device`` at the job's ``threads``, on a
    stubbed Ray and trial: the (hardware id, torch threads) each ``run_trial`` was called with."""
    import torch
    from ray import tune

    import actors.base
    import sequoia_ray.profiling as profiling
    from sequoia_ray.config import ProfileJobConfig
    from sequoia_ray.profiling import TrialResult
    from tuning.profile import trainable

    seen, before = [], torch.get_num_threads()
    row = TrialResult(**{**A_ROW, "predicted_speedup": 1.5})

    def run_trial(cfg, hw_id, **kwargs):
        seen.append((hw_id, torch.get_num_threads()))
        return [row], {}

    monkeypatch.setattr(profiling, "run_trial", run_trial)
    monkeypatch.setattr(profiling, "publish_heatmaps", lambda cfg, hw_id, grids: [])
    monkeypatch.setattr(actors.base, "assigned_device", lambda spec: torch.device(device))
    monkeypatch.setattr(tune, "report", lambda metrics: None)
    job = ProfileJobConfig(storage=str(tmp_path), device=device).model_dump()
    torch.set_num_threads(1)  # as Ray starts a trial of 1 CPU (OMP_NUM_THREADS=1)
    try:
        trainable({"hw": hw, "job": job, "cpus": 1.0, "threads": threads})
        assert torch.get_num_threads() == 1  # put back
    finally:
        torch.set_num_threads(before)
    return seen


def test_a_tensor_parallel_trial_keeps_its_ranks_on_its_node():
    """The ranks' group master is the trial's node address: a rank 0 placed on another node (Tune's default PACK
    spreads a group that does not fit one node) could not listen there and the group never formed."""
    from tuning.profile import trial_bundles, trial_resources

    group = trial_resources("A100", 2, 4.0)
    assert group.strategy == "STRICT_PACK" and group.bundles == trial_bundles("A100", 2, 4.0)
    assert trial_resources("cpu", 1, 2.0).strategy == "PACK"


# ---- the driver, on a stubbed Ray: what it does before and after the trials -------------------------------------
A_ROW = {"hardware": "A", "temperature": 0.0, "n": 8, "d": 4, "expected_tokens": 3.1, "predicted_speedup": 1.9,
         "measured_speedup": 1.7, "measured_tokens_per_step": 3.0, "plan_key": "p", "profile_key": "q"}


@pytest.fixture
def stub_ray(monkeypatch):
    """``ray.init`` a no-op, a cluster of one CPU node and one node of accelerator type A, and a Tuner that records
    that it ran and returns the trials ``stub_ray.results`` says: no Ray cluster is started."""
    import ray
    from ray import tune

    stub = SimpleNamespace(results=[], tuners=[], spaces=[])

    class Tuner:
        def __init__(self, trainable, *, param_space, run_config):
            stub.tuners.append(param_space["hw"])
            stub.spaces.append(param_space)

        def fit(self):
            return stub.results

    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 2.0, "accelerator_type:A": 1.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0}},
                                               {"Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0,
                                                                             "accelerator_type:A": 1.0}}])
    monkeypatch.setattr(tune, "Tuner", Tuner)
    return stub


def test_a_hardware_type_no_node_has_is_refused_before_any_trial(tmp_path, capsys, stub_ray):
    """Its trial waited for ever for a resource ``accelerator_type:H100`` no node offers (Tune logs no error)."""
    argv = ["--storage", str(tmp_path), "--temperatures", "0"]
    assert main([*argv, "--hardware", "A,H100"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--hardware H100: no node of the cluster has the resource accelerator_type:H100" in err
    assert "(its hardware types: A)" in err and "--no-check-placement" in err and not stub_ray.tuners
    with pytest.raises(MissingHardware, match="--hardware cpu: .* resource CPU "):
        check_hardware(["cpu"], {"GPU": 1.0, "accelerator_type:A": 1.0})
    check_hardware(["A", "cpu"], {"CPU": 1.0, "accelerator_type:A": 1.0})
    assert main([*argv, "--hardware", "H100", "--no-check-placement"]) == 0  # the autoscaler may start one
    assert stub_ray.tuners == [{"grid_search": ["H100"]}]


def test_the_trials_get_the_jobs_threads(tmp_path, stub_ray):
    """The trials ran at the torch threads Ray gave their worker (one per reserved CPU), whatever serving uses."""
    assert main(["--storage", str(tmp_path), "--temperatures", "0", "--threads", "3"]) == 0
    assert stub_ray.spaces[0]["threads"] == 3 and stub_ray.spaces[0]["cpus"] == 3.0


def test_a_failed_trial_is_a_line_and_the_others_plans_are_reported(tmp_path, capsys, stub_ray):
    """One failing trial raised RuntimeError with the trial's whole traceback, and no table of the trials that
    succeeded (whose plans were published)."""
    from ray.exceptions import RayTaskError

    from sequoia_ray.hardware import ProfileError

    cause = ProfileError("profile of B: timing noise 31% exceeds the bound 25%")
    error = RayTaskError("train", "Traceback (most recent call last):\n  ...\nProfileError: profile of B: ...", cause,
                         proctitle="ray::ImplicitFunc.train()", pid=1, ip="10.0.0.2").as_instanceof_cause()
    stub_ray.results = [SimpleNamespace(error=None, config={"hw": "A"}, metrics={"results": json.dumps([A_ROW])}),
                        SimpleNamespace(error=error, config={"hw": "B"}, metrics={})]
    assert main(["--storage", str(tmp_path), "--temperatures", "0", "--hardware", "A"]) == EXIT_TRIAL_FAILED == 1
    out = capsys.readouterr().out
    assert [line.split()[:5] for line in out.splitlines() if line.startswith("A ")] == [["A", "0.0", "1", "8", "4"]]
    assert f"plans published under {tmp_path}" in out
    assert "failed: B: ProfileError: profile of B: timing noise 31% exceeds the bound 25%\n" in out
    assert "Traceback" not in out and "ray::" not in out


@pytest.mark.parametrize("error", [
    "Failure # 1 (occurred at 2026-12-06)\nray::ImplicitFunc.train() (pid=1)\n  File \"x.py\", line 3\n"
    "sequoia_ray.hardware.ProfileError: profile of B: timing noise 31% exceeds the bound 25%\n",  # error.txt
    ValueError("profile of B: timing noise 31% exceeds the bound 25%")])
def test_a_failed_trial_is_named_by_its_own_error(error):
    """Tune keeps a trial's error pickled (a ``RayTaskError`` wrapping it: see above) or, when it cannot be
    pickled, as the text of its trace."""
    assert root_cause(error).endswith("Error: profile of B: timing noise 31% exceeds the bound 25%")


def test_the_jobs_default_threads_are_the_shipped_serve_configs():
    """``SERVED_THREADS`` is a constant (the Tune job imports no Serve code): it must stay the target's threads in
    ``deployments/config.yaml``, or the job's CPU plans are filed under an id that config never looks up."""
    from deployments.config import ServeConfig
    from deployments.launch import DEFAULT_CONFIG, app_args
    from tuning.profile import SERVED_THREADS

    assert SERVED_THREADS == ServeConfig.model_validate(app_args(DEFAULT_CONFIG, [])).actor_spec("target").threads


def test_a_trial_no_node_can_hold_is_refused_before_any_trial(tmp_path, capsys, stub_ray):
    """The trials' default CPUs follow --threads (2): on nodes of one CPU each, every CPU trial waited for ever
    (the type exists, so the resource check passed); so did a TP group larger than any node of its type."""
    from tuning.profile import trial_need

    argv = ["--storage", str(tmp_path), "--temperatures", "0"]
    assert main([*argv, "--hardware", "A", "--threads", "6"]) == EXIT_BAD_INPUT  # 6 CPUs; A's node has 4
    err = capsys.readouterr().err
    assert "--hardware A: a trial takes CPU 6, GPU 1" in err and "(the most CPUs of one: 4)" in err
    assert "--threads" in err
    assert main([*argv, "--hardware", "A", "--tp-size", "2", "--threads", "1"]) == EXIT_BAD_INPUT  # 3 GPUs; 2 there
    assert not stub_ray.tuners
    assert trial_need("A", 2, 1.0)["GPU"] == 3 and trial_need("cpu", 1, 2.0) == {"CPU": 2.0}
    assert main([*argv, "--hardware", "A", "--threads", "4"]) == 0 and stub_ray.tuners == [{"grid_search": ["A"]}]
    one_cpu = [{"CPU": 1.0}]
    with pytest.raises(MissingHardware, match="--hardware cpu: a trial takes CPU 2 on one node"):
        check_hardware(["cpu"], {"CPU": 3.0}, one_cpu * 3, lambda hw: trial_need(hw, 1, 2.0))
    check_hardware(["cpu"], {"CPU": 3.0}, one_cpu * 3, lambda hw: trial_need(hw, 1, 1.0))


@pytest.mark.parametrize("storage, needle", [("bogus://x", "cannot open plan store 'bogus://x'"),
                                             ("/proc/nope", "plan store /proc/nope cannot be written")])
def test_a_store_the_job_cannot_write_fails_the_command_before_ray_starts(storage, needle, capsys, monkeypatch):
    """Tune builds its storage under <storage>/tune after ray.init: a bad store was a traceback and exit 1 (the
    RayJob's "a trial failed"), not one line and exit 2 as the profile verb gives."""
    import tuning.profile as job

    monkeypatch.setattr(job, "run", lambda *a: pytest.fail("the job ran with a store it cannot write"))
    assert main(["--storage", storage]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("tuning/profile.py: error: ") and needle in err and "Traceback" not in err


def test_a_hardware_type_given_twice_is_profiled_once(tmp_path):
    """--hardware A100,A100 started two identical trials, each publishing the same plans."""
    cfg, _ = parse_config(["--storage", str(tmp_path), "--hardware", "A100, L4,A100,"])
    assert cfg.hardware == ("A100", "L4")


def test_a_local_store_on_a_cluster_of_several_nodes_is_warned_about(tmp_path, capsys, stub_ray, monkeypatch):
    """Each trial publishes where it runs: a local path on two nodes left plans on each node's own disk, while the
    driver said "plans published under <path>". A URI, or one node, is no warning."""
    assert main(["--storage", str(tmp_path), "--temperatures", "0", "--hardware", "A"]) == 0
    out = capsys.readouterr().out
    assert f"warning: --storage {tmp_path} is a local path on a cluster of 2 nodes" in out
    assert main(["--storage", f"file://{tmp_path}", "--temperatures", "0", "--hardware", "A"]) == 0
    assert f"warning: --storage file://{tmp_path} is a local path" in capsys.readouterr().out
    import ray

    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0,
                                                                             "accelerator_type:A": 1.0}},
                                               {"Alive": False, "Resources": {"CPU": 4.0}}])
    assert main(["--storage", str(tmp_path), "--temperatures", "0", "--hardware", "A"]) == 0
    assert "warning" not in capsys.readouterr().out


def test_a_prompt_file_that_does_not_read_fails_before_ray(tmp_path):
    """A review: ``--prompts /nonexistent`` started local Ray and Tune, whose trial printed its traceback (exit 1);
    ``sequoia-ray profile`` refused it in one line. The job config reads the file, before Ray."""
    with pytest.raises(ValueError, match=r"^--prompts: prompt file .*nothing\.txt: No such file or directory"):
        parse_config(["--storage", str(tmp_path), "--prompts", str(tmp_path / "nothing.txt")])
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        parse_config(["--storage", str(tmp_path), "--prompts", str(tmp_path / "empty.txt")])
