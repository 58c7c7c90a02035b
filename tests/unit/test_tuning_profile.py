"""tuning/profile.py's command line: local paths made absolute for the trials, URIs and number lists kept."""

from __future__ import annotations

import pytest

from tuning.profile import join_uri, parse_config


def test_a_uri_with_any_scheme_is_kept_and_a_relative_path_made_absolute(tmp_path, monkeypatch):
    """``file:/abs/path`` has no '://', and was resolved as a relative path under the working directory."""
    monkeypatch.chdir(tmp_path)
    assert join_uri(f"file:{tmp_path}/store", "tune") == f"file:{tmp_path}/store/tune"
    assert join_uri("s3://b/p?endpoint_override=h:1", "tune") == "s3://b/p/tune?endpoint_override=h:1"
    assert join_uri("plans", "tune") == f"{tmp_path}/plans/tune"
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



def test_a_tensor_parallel_trial_keeps_its_ranks_on_its_node():
    """The ranks' group master is the trial's node address: a rank 0 placed on another node (Tune's default PACK
    spreads a group that does not fit one node) could not listen there and the group never formed."""
    from tuning.profile import trial_bundles, trial_resources

    group = trial_resources("A100", 2, 4.0)
    assert group.strategy == "STRICT_PACK" and group.bundles == trial_bundles("A100", 2, 4.0)
    assert trial_resources("cpu", 1, 2.0).strategy == "PACK"
