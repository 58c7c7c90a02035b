"""The command line's surface: a bad value is refused up front (exit code 2, one line naming it and the fix),
before any model loads or profiling starts, and what a verb reports or records is what it used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.main import main
from sequoia_ray.arguments import Parser, add_job_args, job_config
from sequoia_ray.config import ProfileJobConfig


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def no_models(monkeypatch):
    """Loading the models fails the test: the refusal must come before."""
    import sequoia_ray.local as local
    import sequoia_ray.profiling as profiling

    def load(*args, **kwargs):
        raise AssertionError("the models were loaded before the bad input was refused")

    monkeypatch.setattr(local.LocalPair, "load", classmethod(load))
    monkeypatch.setattr(profiling, "load_pair", load)


@pytest.fixture
def files(tmp_path, monkeypatch):
    """A working folder with a prompt file, acceptance files and inputs nested too deeply to parse."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("hello\nthe cat\n")
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "acc.json").write_text(json.dumps({"p": [0.6, 0.2], "temperature": 0.6}))
    (tmp_path / "bad.json").write_text(json.dumps({"p": [0.9, 0.9]}))
    for name in ("deep.json", "deep.jsonl"):
        (tmp_path / name).write_text("[" * 100_000)
    return tmp_path


def job(*argv: str) -> ProfileJobConfig:
    p = Parser(prog="test")
    add_job_args(p)
    return job_config(p.parse_args(["--storage", "s", *argv]))


# ---- 1: plan --out --------------------------------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--acceptance", "0.6,0.2,0.1", "--budget", "2000"], "budget 2000 must be an integer from 1 to 1024"),
    (["--acceptance", ",".join(["0.0005"] * 1100), "--budget", "8"], "1100 ranks"),
    (["--acceptance", "0.6", "--budget", "8", "--max-depth", "200"], "max_depth 200 must be an integer from 1 to 128"),
])
def test_plan_out_refuses_a_plan_its_file_could_not_hold(tmp_path, capsys, args, needle):
    out = tmp_path / "plan.json"
    assert main(["plan", *args, "--out", str(out)]) == 2
    assert needle in one_error(capsys) and not out.exists()
    assert main(["plan", *args]) == 2  # without --out too: a budget of 3,000,000 ran for minutes, past 1 GB
    assert needle in one_error(capsys)


@pytest.mark.parametrize("verb, flag", [(["plan", "--acceptance", "0.6", "--budget", "4"], "--out"),
                                        (["plan", "--acceptance", "0.6", "--budget", "4"], "--plot"),
                                        (["measure", "--prompts", "prompts.txt"], "--out")])
@pytest.mark.parametrize("path, needle", [("nowhere/x.json", "the folder nowhere does not exist"),
                                          (".", "is a folder; give a file name")])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_work(files, capsys, no_models, verb, flag,
                                                                          path, needle):
    """measure wrote its --out after loading the models and measuring: a missing folder failed at the end."""
    assert main([*verb, flag, path]) == 2
    assert f"{flag} {path}" in (err := one_error(capsys)) and needle in err


# ---- 2: generate --plan, --no-speculation ---------------------------------------------------------
@pytest.mark.parametrize("extra", [["--budget", "8"], ["--max-depth", "unbounded"], ["--acceptance", "0.7"]])
def test_generate_plan_excludes_the_built_in_plans_options(tmp_path, capsys, no_models, extra):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--acceptance", "0.7,0.1", "--budget", "8", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["generate", "--plan", str(plan), "--prompt", "x", *extra]) == 2
    err = one_error(capsys)
    assert f"--plan {plan}" in err and extra[0] in err


def test_generate_without_speculation_reports_the_target_alone(capsys):
    args = ["generate", "--target", "tiny-target", "--draft", "tiny-draft", "--prompt", "ab", "--max-tokens", "4",
            "--json", "--device", "cpu"]
    assert main(args + ["--no-speculation"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["plan"] == {"nodes": 1, "levels": 1} and alone["draft"] is None and alone["target"] == "tiny-target"
    assert main(args + ["--budget", "6"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert 1 < tree["plan"]["nodes"] <= 6 and tree["draft"] == "tiny-draft"


# ---- 3: profile --acceptance T=FILE ---------------------------------------------------------------
def test_an_acceptance_file_for_a_profiled_temperature_is_kept(files):
    assert job("--acceptance", "0.6=acc.json").acceptance == {0.6: "acc.json"}
    assert job("--temperatures", "0", "--acceptance", "0=0.8,0.1").acceptance == {0.0: "0.8,0.1"}


@pytest.mark.parametrize("argv, needle", [
    (["--temperatures", "0", "--acceptance", "0.6=acc.json"], "0.6 is not a profiled temperature"),
    (["--acceptance", "0.6=bad.json"], "--acceptance 0.6=bad.json: bad.json: sum of p"),
    (["--acceptance", "0.6=missing.json"], "does not exist"),
    (["--acceptance", "0.6,0.7=acc.json"], "one temperature T"),
    (["--acceptance", "0=acc.json"], "measured at temperature 0.6, not 0.0"),
    (["--acceptance", "0.6=pair.json"], "measured with draft 'other-draft', not the draft profiled here "
                                        "('default-draft'); measure this pair"),
    (["--target", "models/t", "--acceptance", "0.6=pair.json"], "measured with draft 'other-draft'"),
])
def test_profile_reads_every_acceptance_file_before_the_models_load(files, capsys, no_models, argv, needle):
    (files / "pair.json").write_text(json.dumps({"p": [0.6, 0.2], "temperature": 0.6, "draft": "other-draft",
                                                 "target": "default-target"}))
    assert main(["profile", "--storage", str(files / "store"), *argv]) == 2
    assert needle in one_error(capsys)


@pytest.mark.parametrize("recorded, kept", [
    ("./models/t", True),  # the same folder by another path
    ("/elsewhere/models/t", True),  # a path not here (measured on another machine): cannot be told apart
    ("Qwen/Qwen2.5-1.5B", True),  # a hub id against a local folder (its snapshot?): cannot be told apart
    ("./models/u", False),  # another folder here
])
def test_an_acceptance_file_is_refused_only_for_a_pair_surely_not_this_one(files, capsys, recorded, kept):
    for folder in ("models/t", "models/u"):
        (files / folder).mkdir(parents=True, exist_ok=True)
    (files / "pair.json").write_text(json.dumps({"p": [0.6], "temperature": 0.6, "draft": "default-draft",
                                                 "target": recorded}))
    argv = ["--target", str(files / "models" / "t"), "--acceptance", "0.6=pair.json"]
    if kept:
        assert job(*argv).acceptance == {0.6: "pair.json"}
    else:
        with pytest.raises(ValueError, match="measured with target .*models/u"):
            job(*argv)


# ---- 4: temperatures ------------------------------------------------------------------------------
def test_profiled_temperatures_are_a_requests_and_each_once():
    for bad in ((150.0,), (0.0, 100.5)):
        with pytest.raises(ValueError, match="must be from 0 to 100"):
            ProfileJobConfig(storage="s", temperatures=bad)
    assert ProfileJobConfig(storage="s", temperatures=(0.6, 0, 0.0, 0.6)).temperatures == (0.6, 0.0)
    assert job("--temperatures", "0,0,0.6").temperatures == (0.0, 0.6)


def test_profiled_temperatures_in_one_plan_bucket_are_refused():
    """0.6 and 0.64 are both stored as bucket t0.6: the plans of the one profiled last overwrote the other's."""
    for temps, needle in [((0.6, 0.64), "0.6 and 0.64 both fall in the plan bucket t0.6"),
                          ((0.0, 0.7, 0.04), "0.0 and 0.04 both fall in the plan bucket t0.0")]:
        with pytest.raises(ValueError, match=needle + r" .*keep one of them"):
            ProfileJobConfig(storage="s", temperatures=temps)
    with pytest.raises(ValueError, match="0.6 and 0.64 both fall in the plan bucket t0.6"):
        job("--temperatures", "0.6,0.64")
    assert ProfileJobConfig(storage="s", temperatures=(0.64, 0.66)).temperatures == (0.64, 0.66)  # t0.6, t0.7


@pytest.mark.parametrize("value", ["150", "inf", "nan"])
def test_measure_refuses_a_temperature_no_request_may_ask_for(files, capsys, no_models, value):
    assert main(["measure", "--prompts", "prompts.txt", "--out", "a.json", "--temperature", value]) == 2
    err = one_error(capsys)
    assert f"'{value}'" in err and "less than or equal to 100" in err


# ---- 5, 13: the store ------------------------------------------------------------------------------
@pytest.mark.parametrize("storage, needle", [("", "storage '' is empty"), (" ", "is empty"),
                                              ("/proc/nope", "plan store /proc/nope cannot be written")])
def test_profile_refuses_a_store_it_cannot_write_before_the_models_load(files, capsys, no_models, storage, needle):
    assert main(["profile", "--storage", storage]) == 2
    assert needle in one_error(capsys)
    assert not list(files.glob("plans")) and not list(files.glob("profiles"))


def test_a_new_local_store_is_made_and_left_without_a_probe_and_an_unreachable_uri_is_refused(tmp_path):
    from sequoia_ray.plan_store import PlanStore, StoreError

    PlanStore(str(tmp_path / "new" / "store")).check_writable()
    assert (tmp_path / "new" / "store").is_dir() and not list((tmp_path / "new" / "store").iterdir())
    with pytest.raises(StoreError, match="s3://bucket/p cannot be written .*check its URI, endpoint and credentials"):
        PlanStore("s3://bucket/p?endpoint_override=127.0.0.1:1&scheme=http").check_writable()  # said before profiling


def test_measure_width_has_the_profiling_jobs_bound(files, capsys, no_models):
    assert main(["measure", "--prompts", "prompts.txt", "--out", "a.json", "--width", "65"]) == 2
    assert "'65': input should be less than or equal to 64" in one_error(capsys)


# ---- 6: empty prompt files -------------------------------------------------------------------------
@pytest.mark.parametrize("verb", [["measure", "--out", "a.json"], ["profile", "--storage", "store"]])
def test_an_empty_prompt_file_is_refused_before_the_models_load(files, capsys, no_models, verb):
    assert main([*verb, "--prompts", "blank.txt"]) == 2
    assert "prompt file blank.txt holds no prompts" in one_error(capsys)


# ---- 7: inputs nested too deeply -------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["plan", "--acceptance", "deep.json", "--budget", "4"], "acceptance file deep.json is JSON nested too deeply"),
    (["plan", "--acceptance", "0.6", "--budget", "4", "--profile", "deep.json"], "nested too deeply"),
    (["measure", "--prompts", "deep.jsonl", "--out", "a.json"], "deep.jsonl:1: expected a JSON object"),
    (["serve", "--config", "deep.json"], "nested too deeply"),
])
def test_an_input_nested_too_deeply_is_a_one_line_error(files, capsys, no_models, argv, needle):
    assert main(argv) == 2
    assert needle in one_error(capsys)


# ---- 8: measure records the pair it loaded ---------------------------------------------------------
def test_measure_records_the_default_pair_it_loaded(files, monkeypatch, capsys):
    """Without --draft / --target the default pair is loaded (here made the tiny pair, whose names it records)."""
    from sequoia_ray.local import LocalPair

    real = LocalPair.load.__func__
    monkeypatch.setattr(LocalPair, "load", classmethod(
        lambda cls, target="tiny-target", draft="tiny-draft", **kw: real(cls, target, draft, **kw)))
    assert main(["measure", "--prompts", "prompts.txt", "--out", "m.json", "--width", "2", "--max-tokens", "4",
                 "--device", "cpu"]) == 0
    recorded = json.loads(Path("m.json").read_text())
    assert (recorded["draft"], recorded["target"]) == ("tiny-draft", "tiny-target")


def test_measure_records_a_local_models_path_absolute(files, monkeypatch, capsys):
    """Recorded as given ('./models/t'), a profile run from another folder read another path: it is absolute."""
    from sequoia_ray.local import LocalPair

    real = LocalPair.load.__func__
    (files / "models" / "t").mkdir(parents=True)

    def load(cls, target, draft, **kw):  # the tiny pair, its target named as the command line gave it
        pair = real(cls, "tiny-target", "tiny-draft", **kw)
        object.__setattr__(pair.target, "name", target)  # LoadedModel is frozen
        return pair

    monkeypatch.setattr(LocalPair, "load", classmethod(load))
    assert main(["measure", "--prompts", "prompts.txt", "--out", "m.json", "--width", "2", "--max-tokens", "4",
                 "--device", "cpu", "--target", "./models/t", "--draft", "tiny-draft"]) == 0
    assert json.loads(Path("m.json").read_text())["target"] == str(files / "models" / "t")


# ---- 11: booleans are not probabilities ------------------------------------------------------------
@pytest.mark.parametrize("obj", [{"p": [True]}, {"p": [0.5], "reject": False}, {"p": [[0.5], [True]]},
                                 {"p": ["0.5"]}])
def test_an_acceptance_vector_of_booleans_is_refused(tmp_path, capsys, obj):
    from sequoia_ray.tree.acceptance_vector import AcceptanceError, AcceptanceVector

    with pytest.raises(AcceptanceError, match="must hold numbers"):
        AcceptanceVector.from_dict(obj)
    (tmp_path / "acc.json").write_text(json.dumps(obj))
    assert main(["plan", "--acceptance", str(tmp_path / "acc.json"), "--budget", "4"]) == 2
    assert "must hold numbers" in one_error(capsys)


# ---- 12: serve --config http_options ---------------------------------------------------------------
@pytest.mark.parametrize("given, served", [([], ("0.0.0.0", 8123)), (["--port", "9000"], ("0.0.0.0", 9000)),
                                           (["--host", "127.0.0.1"], ("127.0.0.1", 8123))])
def test_serve_listens_where_the_config_says_unless_told_otherwise(tmp_path, monkeypatch, given, served):
    from deployments import launch

    config = tmp_path / "serve.yaml"
    config.write_text("http_options: {host: 0.0.0.0, port: 8123}\napplications:\n  - args: {draft: tiny-draft, "
                      "target: tiny-target, plan_store: null}\n")

    class Started(BaseException):  # not an error the launcher stops the app for
        pass

    def start(args, port, address, quiet=True, host="127.0.0.1"):
        raise Started(host, port)

    monkeypatch.setattr(launch, "init_ray", lambda address, quiet: None)
    monkeypatch.setattr(launch, "ensure_plans", lambda cfg, seconds, address=None: "skipped")
    monkeypatch.setattr(launch, "start", start)
    with pytest.raises(Started) as started:
        launch.main(["--config", str(config), *given])
    assert started.value.args == served


def test_a_config_without_http_options_serves_on_the_loopback(tmp_path):
    from deployments import launch

    assert launch.http_options(launch.DEFAULT_CONFIG) == ("127.0.0.1", 8000)
    config = tmp_path / "serve.yaml"
    config.write_text("applications: []\n")
    assert launch.http_options(config) == ("127.0.0.1", 8000)
    config.write_text("http_options: {port: 99999}\n")
    with pytest.raises(ValueError, match="http_options port '99999' is not a TCP port"):
        launch.http_options(config)


# ---- session 56: a review of the command line -------------------------------------------------------
@pytest.mark.parametrize("args, needle", [
    (["--budget", "5000"], "budget 5000 must be an integer from 1 to 1024"),  # ran a 5,000-node tree
    (["--budget", "8", "--max-depth", "200"], "max_depth 200 must be an integer from 1 to 128"),
])
def test_generate_refuses_a_built_in_plan_past_a_plan_files_limits_before_the_models_load(capsys, no_models, args,
                                                                                          needle):
    assert main(["generate", "--target", "tiny-target", "--prompt", "x", *args]) == 2
    assert needle in one_error(capsys)


def test_draft_vocab_takes_null_as_its_help_says():
    assert job("--draft-vocab", "null").draft_vocab is None and job("--draft-vocab", "full").draft_vocab is None


def test_a_validators_message_reaches_the_user_without_pydantics_prefix(capsys, no_models):
    assert main(["generate", "--target", "tiny-target", "--prompt", "x", "--stop", "a", "--stop", "b", "--stop", "c",
                 "--stop", "d", "--stop", "e"]) == 2
    err = one_error(capsys)
    assert "stop strings" in err and "Value error" not in err


def test_a_reader_that_stops_reading_ends_the_command_quietly(monkeypatch, capsys):
    """``sequoia-ray generate … | head -c1``: the closed pipe was reported as bad input (exit 2)."""
    import cli.main as cli

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_run_generate", closed)
    assert main(["generate", "--target", "tiny-target", "--prompt", "x"]) == cli.EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def test_a_config_whose_args_are_not_a_mapping_names_the_file(tmp_path):
    from deployments import launch

    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n  - args: abc\n")  # "dictionary update sequence element #0 has length 1"
    with pytest.raises(ValueError, match=f"config '{config}' has no 'applications:' list with an application's"):
        launch.app_args(config, [])
    config.write_text("applications: [\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        launch.app_args(config, [])
