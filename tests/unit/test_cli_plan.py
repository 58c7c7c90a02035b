"""``sequoia-ray plan``: JSON output, plan file, plot, and exit code 2 with one line on bad input."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from sequoia_ray.tree.acceptance_vector import AcceptanceVector
from sequoia_ray.tree.dp import solve
from sequoia_ray.tree.plan_file import PlannedTree


def test_plan_json_output_and_files(tmp_path, capsys):
    acc = tmp_path / "acc.json"
    acc.write_text(json.dumps({"p": [0.6, 0.2, 0.1], "reject": 0.1, "temperature": 0.6}))
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    code = main(["plan", "--acceptance", str(acc), "--budget", "24", "--max-depth", "5", "--json",
                 "--out", str(out), "--plot", str(png)])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    expected = solve(AcceptanceVector.from_p([0.6, 0.2, 0.1]), 24, 5).value(24, 5)
    assert printed["expected_tokens"] == pytest.approx(expected, abs=1e-12)
    assert printed["budget"] == 24 and printed["max_depth"] == 5 and printed["depth"] <= 5
    assert len(printed["parents"]) <= 24
    assert PlannedTree.load(out).to_dict() == printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plan_unbounded_text_output(capsys):
    assert main(["plan", "--acceptance", "0.8", "--budget", "6"]) == 0
    text = capsys.readouterr().out
    assert "d=unbounded" in text and "6 levels" in text  # p = [0.8]: the best 6-node tree is a chain


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--acceptance", "0.7,0.6", "--budget", "8"], "sum of p is 1.3"),
        (["--acceptance", "x,y", "--budget", "8"], "neither a JSON file"),
        (["--acceptance", "0.5", "--budget", "0"], "must be >= 1"),
        (["--acceptance", "0.5", "--budget", "8", "--max-depth", "zero"], "not an integer"),
        (["--acceptance", "/nonexistent/acc.json", "--budget", "8"], "does not exist"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1, err


def test_long_inline_acceptance_list_is_a_list(capsys):
    """A measured vector pasted inline (32 values) is longer than a file name may be: still a list."""
    p = [0.5 / 2**k for k in range(32)]
    text = ",".join(f"{x:.17g}" for x in p)
    assert len(text) > 255  # NAME_MAX: Path(text).is_file() would raise "File name too long"
    assert main(["plan", "--acceptance", text, "--budget", "8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["expected_tokens"] == pytest.approx(solve(AcceptanceVector.from_p(p), 8, None).value(8, None))


def test_acceptance_that_is_no_list_and_no_file_names_the_value(capsys, tmp_path):
    missing = str(tmp_path / "measured-acceptance")
    assert main(["plan", "--acceptance", missing, "--budget", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert missing in err and "neither a JSON file" in err and len(err.splitlines()) == 1


def test_plan_imports_neither_torch_transformers_nor_ray(tmp_path):
    """`plan` needs numpy and the tree package: run it in a fresh interpreter and look at sys.modules."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\nfrom cli.main import build_parser, main\nbuild_parser()\n"
            "assert main(['plan', '--acceptance', '0.8,0.1', '--budget', '4']) == 0\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules)\n"
            "print('HEAVY', heavy)\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


@pytest.mark.parametrize("args,needle", [
    (["--set", "tp_size=2", "--set", "tp_backend=nccl"], "set tp_backend: gloo"),
    (["--set", "device=tpu"], "device"),
    (["--port", "x"], "is not a TCP port"),
    (["--profile-seconds", "-5"], "must be a finite number >= 0"),
    (["--profile-seconds", "inf"], "must be a finite number >= 0"),  # it loaded the models, then failed
])
def test_serve_rejects_a_bad_config_in_one_line_before_starting_ray(args, needle, capsys):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_plan_with_a_profile_prints_the_best_tree_per_batch_bucket(tmp_path, capsys):
    from sequoia_ray.hardware import choose
    from tests.unit.test_hardware import batched

    prof = batched(per_token=0.05, draft=0.2)
    prof.save(tmp_path / "profile.json")
    args = ["plan", "--acceptance", "0.7,0.1,0.05", "--budget", "32", "--max-depth", "6",
            "--profile", str(tmp_path / "profile.json")]
    assert main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["batch_buckets"]
    table = solve(AcceptanceVector.from_p([0.7, 0.1, 0.05]), 32, 6)
    for row in rows:
        best, _ = choose(table, prof, (1, 2, 4, 6, 8, 12, 16, 24, 32), batch=row["batch"])
        assert (row["n"], row["d"], row["speedup"]) == (best.n, best.d, best.predicted_speedup)
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * row["expected_tokens"] / row["step_s"])
    assert [r["batch"] for r in rows] == [1, 2, 4, 8, 16]
    assert rows[0]["n"] > rows[-1]["n"]  # the tree shrinks as the batch grows
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "per batch bucket" in text and text.rstrip().splitlines()[-1].split()[:3] == ["16", str(rows[-1]["n"]),
                                                                                         str(rows[-1]["d"])]


def test_plan_with_a_broken_profile_exits_2(tmp_path, capsys):
    (tmp_path / "profile.json").write_text("{}")
    assert main(["plan", "--acceptance", "0.7", "--budget", "8", "--profile", str(tmp_path / "profile.json")]) == 2
    assert "schema_version" in capsys.readouterr().err


def test_profile_files_its_plans_under_the_threads_the_service_will_run(tmp_path, monkeypatch, capsys):
    """``deployments/config.yaml`` serves with ``threads: 2``; on a machine with more cores ``sequoia-ray profile``
    timed and filed its plans under every core ('-16c'), where the service never looked."""
    import torch

    import sequoia_ray.profiling as profiling
    from sequoia_ray.hardware import hardware_id

    seen, before = [], torch.get_num_threads()
    monkeypatch.setattr(profiling, "run_trial", lambda cfg, hw: seen.append((hw, torch.get_num_threads())) or ([], {}))
    monkeypatch.setattr(profiling, "publish_heatmaps", lambda cfg, hw, grids: [])
    monkeypatch.setattr(profiling, "format_results", lambda results: "")
    assert main(["profile", "--storage", str(tmp_path), "--threads", "3"]) == 0
    assert seen == [(hardware_id(None, 1, 3), 3)] and torch.get_num_threads() == before  # put back
    assert f"plans filed under hardware id {hardware_id(None, 1, 3)}" in capsys.readouterr().out
    assert main(["profile", "--storage", str(tmp_path), "--threads", "0"]) == 2
    # without --threads: the shipped config's 2 (it was one per core: '-16c' plans the default service never read)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    seen.clear()
    assert main(["profile", "--storage", str(tmp_path)]) == 0
    assert [hw for hw, _ in seen] == [hardware_id(None, 1, 2)]


def test_a_profile_that_does_not_read_is_refused_before_out_is_written(tmp_path, capsys):
    """A review: ``--profile nofile.json`` wrote ``--out``, then said "[Errno 2] No such file or directory: ..." with
    neither the flag nor the fix."""
    from cli.main import main

    out = tmp_path / "o.json"
    for given, said in ((tmp_path / "nofile.json", "No such file or directory"), (tmp_path, "Is a directory")):
        assert main(["plan", "--acceptance", "0.6,0.2", "--budget", "4", "--out", str(out), "--profile",
                     str(given)]) == 2
        assert f"--profile {given}: {said}; give a hardware profile" in capsys.readouterr().err
        assert not out.exists()
