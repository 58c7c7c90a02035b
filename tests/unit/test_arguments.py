"""The shared command-line helpers: the profiling job's options take their defaults from the model."""

from __future__ import annotations

import pytest

from sequoia_ray.arguments import Parser, add_job_args, described, job_config, one_line
from sequoia_ray.config import ProfileJobConfig, SamplingParams


def parse(*argv: str):
    p = Parser(prog="test")
    add_job_args(p)
    return p.parse_args(list(argv))


def test_unset_options_take_the_model_defaults():
    assert job_config(parse("--storage", "/tmp/s")) == ProfileJobConfig(storage="/tmp/s")


def test_given_options_override_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.json").write_text('{"p": [0.6, 0.2]}')
    cfg = job_config(parse("--storage", "s", "--budgets", "4,2", "--temperatures", "0.6", "--max-depth", "3",
                           "--dtype", "float32", "--acceptance", "0.6=a.json", "--smoke-test", "--layers", "eager"))
    assert cfg.budgets == (1, 2, 4) and cfg.temperatures == (0.6,) and cfg.max_depth == 3 and cfg.layers == "eager"
    assert cfg.draft_vocab == 65536  # the default
    assert job_config(parse("--storage", "s", "--draft-vocab", "full")).draft_vocab is None
    assert job_config(parse("--storage", "s", "--draft-vocab", "32768")).draft_vocab == 32768
    assert cfg.dtype == "float32" and cfg.acceptance == {0.6: "a.json"} and cfg.smoke_test
    assert cfg.draft == ProfileJobConfig.model_fields["draft"].default


@pytest.mark.parametrize("argv,needle", [
    (["--budgets", "1.5"], "whole numbers"), (["--temperatures", "x"], "comma-separated numbers"),
    (["--acceptance", "acc.json"], "T=FILE"), (["--max-depth", "0"], "max_depth")])
def test_bad_job_options_name_the_value(argv, needle):
    with pytest.raises(ValueError) as err:
        job_config(parse("--storage", "s", *argv))
    assert needle in one_line(err.value)


@pytest.mark.parametrize("value,needle", [("0", "0 must be >= 1"), ("half", "'half' is not an integer")])
def test_a_bad_draft_vocab_is_a_one_line_usage_error(value, needle, capsys):
    with pytest.raises(SystemExit) as out:
        parse("--storage", "s", "--draft-vocab", value)
    assert out.value.code == 2 and needle in capsys.readouterr().err


def test_help_shows_the_model_default():
    assert described(SamplingParams, "max_tokens").endswith("(default: 128)")
    assert "(default: 1,2,4,8" in described(ProfileJobConfig, "budgets")


def test_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--storage")
    assert exc.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_max_noise_is_a_job_option_checked_as_the_model_checks_it(capsys):
    """``check_noise``'s refusal says to raise the bound, but no option set it: only the model's default 0.25."""
    assert job_config(parse("--storage", "s", "--max-noise", "0.5")).max_noise == 0.5
    assert job_config(parse("--storage", "s")).max_noise == ProfileJobConfig.model_fields["max_noise"].default
    p = Parser(prog="test")
    add_job_args(p)
    assert "--max-noise FRACTION" in p.format_help()  # argparse %-formats help: a '%' in a description breaks it
    for bad in ("0", "-0.1", "nan", "lots"):
        with pytest.raises(SystemExit) as out:
            parse("--storage", "s", "--max-noise", bad)
        err = capsys.readouterr().err
        assert out.value.code == 2 and len(err.strip().splitlines()) == 1
        assert f"argument --max-noise: '{bad}': input should be " in err, err  # greater than 0 / a valid number
    with pytest.raises(SystemExit):
        parse("--storage", "s", "--max-noise", "25")  # meant as 25%: a bound of 2500%, the check off
    assert "'25' is over 1 (100%): a fraction, e.g. 0.25 for 25%; did you mean 0.25?" in capsys.readouterr().err
    assert job_config(parse("--storage", "s", "--max-noise", "1")).max_noise == 1.0


@pytest.mark.parametrize("argv", [["plan", "--acceptance", "0.6", "--budget", "4", "--out", "~nouser-s65/p.json"],
                                  ["generate", "--prompt", "hi", "--draft", "~nouser-s65/m"]])
def test_a_home_of_no_user_is_refused_in_one_line_not_a_traceback(argv, capsys):
    """A review: ``--storage '~plans'`` (a typo for ``~/plans``), ``--out ~nouser/p.json`` and five more ended in
    pathlib's RuntimeError "Could not determine home directory." and a traceback."""
    from cli.main import main
    from sequoia_ray.paths import user_path

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'~nouser-s65' names no user with a home directory here" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(ValueError, match=r"^~nouser-s65/x: '~nouser-s65' names no user .*give an absolute path"):
        user_path("~nouser-s65/x")
    assert str(user_path("~/x")).endswith("/x") and not str(user_path("~/x")).startswith("~")


@pytest.mark.parametrize("text", ["inf", "1e400", "nan", "-1"])
def test_a_non_negative_float_flag_must_be_finite(text):
    """A review: ``serve --profile-seconds inf`` loaded the models, then profiling failed on int(inf x a share) and
    the built-in plan was served, exit 0."""
    import argparse

    from sequoia_ray.arguments import nonneg_float

    with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number >= 0"):
        nonneg_float(text)
    assert nonneg_float("0") == 0.0 and nonneg_float("120") == 120.0


def test_an_error_across_fields_is_its_message_alone():
    """A review: a check across fields (pydantic's model validator, ``loc`` empty) read "error: : prefill_chunk 4096
    is larger ... (got {'model_name': 'sequoia-default', ...)"."""
    from pydantic import ValidationError

    from deployments.config import ServeConfig
    from sequoia_ray.arguments import one_line

    with pytest.raises(ValidationError) as caught:
        ServeConfig(prefill_chunk=4096)
    said = one_line(caught.value)
    assert said.startswith("prefill_chunk 4096 is larger than max_batch_tokens") and "(got {" not in said, said
    with pytest.raises(ValidationError) as caught:
        ServeConfig(max_concurrent=0)
    assert one_line(caught.value).startswith("max_concurrent: ") and "(got 0)" in one_line(caught.value)
