"""benchmarks/load.py's service config: its own, or a serve config file's (what ships) with the flags on top."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from deployments.launch import DEFAULT_CONFIG, app_args

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import load  # noqa: E402


def _args(*argv: str):
    """load.py's parsed command line (its parser, without running anything)."""
    parsed = {}

    def stop(args):
        parsed["args"] = args
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["load.py", *argv])
        mp.setattr(load, "build_config", lambda args, clients: stop(args))
        with pytest.raises(SystemExit):
            load.main()
    return parsed["args"]


def test_without_a_config_file_the_benchmarks_own_config():
    cfg = load.build_config(_args("--real", "--clients", "8", "--live-cost"), 8)
    assert cfg["target"] == "default-target" and cfg["num_cpus"] == 2 and cfg["tp_size"] == 1
    assert cfg["live_cost"] is True and "dynamic_trees" not in cfg and cfg["max_concurrent"] == 8


def test_the_shipped_config_with_the_flags_given_on_top(tmp_path):
    shipped = app_args(DEFAULT_CONFIG, [])
    assert shipped["dynamic_trees"] is True and shipped["live_cost"] is True  # what (c) then runs
    cfg = load.build_config(_args("--config", str(DEFAULT_CONFIG), "--clients", "1,8", "--plan-store",
                                  str(tmp_path), "--set", "request_trees=true"), 8)
    assert cfg["plan_store"] == str(tmp_path) and cfg["request_trees"] is True and cfg["max_concurrent"] == 8
    assert cfg["model_name"] == load.MODEL  # the clients' model name
    for key in ("dynamic_trees", "dynamic_extend", "live_cost", "live_cost_max_age_s", "draft_quantize", "num_cpus",
                "threads", "tp_size", "dtype"):
        assert cfg[key] == shipped[key], key
    assert load.pair_name(cfg) == "real"
    # a flag given wins over the file
    assert load.build_config(_args("--config", str(DEFAULT_CONFIG), "--num-cpus", "2"), 1)["num_cpus"] == 2


@pytest.mark.parametrize("argv, message", [
    (("--config", "{missing}"), "not a serve config"),
    (("--config", "{bad}"), "not a serve config"),
    (("--tiny", "--config", "{shipped}"), "leave out --tiny"),
    (("--config", "{shipped}", "--set", "live_cost_max_age_s=-1"), "live_cost_max_age_s"),
    (("--config", "{shipped}", "--set", "prefill_chunk"), "give KEY=VALUE"),
    (("--config", "{shipped}", "--set", "prefill_chunk=[1"), "not valid YAML"),
])
def test_a_bad_config_names_the_value_and_the_fix(tmp_path, argv, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: []\n")
    paths = {"missing": tmp_path / "none.yaml", "bad": bad, "shipped": DEFAULT_CONFIG}
    with pytest.raises(SystemExit, match=message):
        load.build_config(_args(*(a.format(**paths) for a in argv)), 1)


@pytest.mark.parametrize("kind", ["missing", "folder", "not utf-8"])
def test_a_config_file_that_does_not_read_names_config_and_the_fix(tmp_path, kind):
    """A review: "[Errno 2] No such file or directory: ...", "[Errno 21] Is a directory" and, for a file not in
    UTF-8, "'utf-8' codec can't decode byte 0xff in position 38" with no file named."""
    from deployments.launch import _spec

    path = {"missing": tmp_path / "nothing.yaml", "folder": tmp_path}.get(kind, tmp_path / "latin1.yaml")
    if kind == "not utf-8":
        path.write_bytes(b"applications:\n- args: {model_name: \"\xff\"}\n")
    with pytest.raises(ValueError, match=rf"^--config '{path}': .*; give a Serve config file \(YAML, UTF-8\)"):
        _spec(path)


@pytest.mark.parametrize("text, said", [
    ("http_option: {port: 18999}\napplications: [{args: {}}]\n", "unknown key(s) http_option; a Serve config has"),
    ("applications: [{args: {}, route_prefx: /api}]\n", "unknown application key(s) route_prefx"),
    ("applications: [{args: {}, route_prefix: /api}]\n", "application route_prefix '/api': `sequoia-ray serve` "
                                                         "serves 'sequoia' at '/'"),
    ("applications: [{name: myapp, args: {}}]\n", "application name 'myapp'"),
    ("applications: [{args: {}}, {args: {}}]\n", "2 applications; `sequoia-ray serve` runs one"),
])
def test_what_the_launcher_would_drop_from_a_config_is_refused(tmp_path, text, said):
    """A review: a typo (``http_option``), a route prefix, an application name and a second application all passed,
    and the launcher served app 'sequoia' at '/' on port 8000 without a word."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(said)):
        app_args(path, [])


@pytest.mark.parametrize("text", ["tracing_config: {exporter_import_path: m:f}\napplications: [{args: {}}]\n",
                                  "controller_options: {}\napplications: [{args: {}}]\n",
                                  "applications: [{args: {}, autoscaling_policy: null, route_prefix: null}]\n"])
def test_every_key_rays_serve_config_has_is_taken(tmp_path, text):
    """The review of the check above: Ray 2.60's tracing_config, controller_options and an application's
    autoscaling_policy were refused as keys "no Serve config has", and route_prefix null (Ray's default) too."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert app_args(path, []) == {}
