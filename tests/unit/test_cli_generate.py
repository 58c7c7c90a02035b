"""``sequoia-ray generate`` and ``measure`` end to end on tiny checkpoints written to disk."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from tests.tiny import save_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tiny"))


def run_json(capsys, *args) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_speculative_equals_target_alone(pair, capsys):
    target, draft = pair
    common = ["generate", "--target", str(target), "--draft", str(draft), "--prompt", "hello world",
              "--max-tokens", "24", "--json", "--device", "cpu"]
    spec = run_json(capsys, *common, "--budget", "12", "--max-depth", "5")
    alone = run_json(capsys, *common, "--no-speculation")
    assert spec["token_ids"] == alone["token_ids"] and len(spec["token_ids"]) == 24
    assert spec["text"] == alone["text"]
    assert spec["tokens_per_step"] > 1.0 and alone["tokens_per_step"] == 1.0
    assert spec["tokens_per_second"] > 0 and spec["plan"]["nodes"] <= 12


def test_generate_with_plan_file_and_sampling(pair, capsys, tmp_path):
    target, draft = pair
    plan = tmp_path / "plan.json"
    assert main(["plan", "--acceptance", "0.7,0.1", "--budget", "8", "--max-depth", "4", "--out", str(plan)]) == 0
    capsys.readouterr()
    args = ["generate", "--target", str(target), "--draft", str(draft), "--plan", str(plan), "--prompt", "abc",
            "--max-tokens", "16", "--temperature", "0.8", "--seed", "4", "--json"]
    first, second = run_json(capsys, *args), run_json(capsys, *args)
    assert first["token_ids"] == second["token_ids"]
    assert first["seed"] == 4


def test_measure_writes_a_vector_plan_reads(pair, capsys, tmp_path):
    target, draft = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "the cat", "chat": true}\n')
    out = tmp_path / "acc.json"
    assert main(["measure", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
                 "--width", "4", "--max-tokens", "12", "--out", str(out)]) == 0
    acc = json.loads(out.read_text())
    assert len(acc["p"]) == 4 and acc["steps"] > 0
    assert abs(sum(acc["p"]) + acc["reject"] - 1) < 1e-9
    assert acc["p"][0] > 0.3  # the noisy copy agrees with the target most of the time
    capsys.readouterr()
    assert main(["plan", "--acceptance", str(out), "--budget", "10", "--json"]) == 0


@pytest.mark.parametrize(
    "args,needle",
    [(["--prompt", "x", "--temperature", "-1"], "must be a finite number >= 0"),
     (["--prompt", "x", "--top-p", "0"], "top_p"),
     (["--prompt", "x", "--plan", "/nonexistent.json"], "cannot read plan file"),
     (["--prompt", "x", "--target", "/nonexistent-dir"], "")],
)
def test_generate_bad_input(pair, capsys, args, needle):
    target, draft = pair
    base = ["generate", "--draft", str(draft)] + ([] if "--target" in args else ["--target", str(target)])
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_generate_streams_its_text_as_a_line_and_the_summary_apart(pair, capsys):
    target, draft = pair
    assert main(["generate", "--target", str(target), "--draft", str(draft), "--prompt", "abc",
                 "--max-tokens", "6", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and out.count("\n") >= 1  # the shell prompt starts on a line of its own
    assert err.splitlines()[-1].startswith("--- ") and "tokens/step" in err
