"""scripts/*.sh on a copy of the repo whose .venv is a stub that logs how it is called (nothing is installed or
served): relative paths stay the caller's, unknown arguments are refused, a chosen torch build is kept."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
STUB = """#!/bin/sh
echo "$(basename "$0") cwd=$(pwd) args=$*" >> "{log}"
"""


@pytest.fixture
def repo(tmp_path):
    """A repo copy: the real scripts, a pyproject.toml, and a .venv whose python and sequoia-ray log their calls."""
    root = tmp_path / "repo"
    shutil.copytree(SCRIPTS, root / "scripts")
    (root / "pyproject.toml").write_text("[project]\nname = 'stub'\n")
    bin_ = root / ".venv" / "bin"
    bin_.mkdir(parents=True)
    for name in ("python", "sequoia-ray"):
        (bin_ / name).write_text(STUB.format(log=tmp_path / "calls.log"))
        (bin_ / name).chmod(0o755)
    return root


def run(script: Path, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SEQUOIA_TORCH")}
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env={**clean, **env}, capture_output=True,
                          text=True, timeout=60)


def calls(repo: Path) -> list[str]:
    log = repo.parent / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return lines


def test_main_runs_the_service_in_the_callers_folder(repo, tmp_path):
    """``--config my.yaml`` and ``--set plan_store=./x`` name the caller's files (main.sh ran the CLI in the repo)."""
    caller = tmp_path / "caller"
    caller.mkdir()
    (repo / ".venv" / ".sequoia-ray-installed").write_text("stale")  # setup.sh runs: it goes through the stub
    out = run(repo / "scripts" / "main.sh", "--config", "my.yaml", "--set", "plan_store=./x", "--exit", cwd=caller)
    assert out.returncode == 0, out.stderr
    served = [c for c in calls(repo) if c.startswith("sequoia-ray")]
    assert served == [f"sequoia-ray cwd={caller} args=serve --demo --config my.yaml --set plan_store=./x --exit"]
    out = run(repo / "scripts" / "main.sh", "--exit", cwd=caller)  # the default config: the repo's store
    assert out.returncode == 0, out.stderr
    served = [c for c in calls(repo) if c.startswith("sequoia-ray")]
    assert served == [f"sequoia-ray cwd={caller} args=serve --demo --set plan_store={repo}/.sequoia/plans --exit"]
    assert (repo / ".sequoia" / "plans").is_dir() and not (caller / ".sequoia").exists()


@pytest.mark.parametrize("script, args", [("gpu_check.sh", ["--quik"]), ("gpu_check.sh", ["--quick", "extra"]),
                                          ("vllm_venv.sh", ["--help-me"]), ("vllm_venv.sh", ["a", "b"])])
def test_an_unknown_argument_is_refused_with_the_usage(repo, tmp_path, script, args):
    out = run(repo / "scripts" / script, *args, cwd=tmp_path, PYTHON="false")
    assert out.returncode == 2 and "usage:" in out.stderr, (out.returncode, out.stderr)
    assert calls(repo) == [] and not (tmp_path / args[0]).exists()  # nothing set up, no venv made


def test_vllm_venv_help_prints_the_usage(repo, tmp_path):
    out = run(repo / "scripts" / "vllm_venv.sh", "--help", cwd=tmp_path, PYTHON="false")
    assert out.returncode == 0 and out.stdout.startswith("usage:") and not (tmp_path / "--help").exists()


def test_a_torch_build_chosen_once_is_kept_by_later_set_ups(repo):
    """gpu_check.sh sets SEQUOIA_TORCH=torch==2.13.0; main.sh and test.sh run setup.sh without it, which took the
    stamp for stale and put the CPU build back (and gpu_check.sh the CUDA one after that, every time)."""
    setup = repo / "scripts" / "setup.sh"

    def pip_installs() -> list[str]:
        return [c.split("args=", 1)[1] for c in calls(repo) if "-m pip" in c and " install " in c]

    assert run(setup, cwd=repo, SEQUOIA_TORCH="torch==2.13.0").returncode == 0
    assert any("install --no-compile torch==2.13.0" in c for c in pip_installs())
    assert run(setup, cwd=repo).returncode == 0  # as main.sh / test.sh run it
    assert pip_installs() == []
    assert run(setup, cwd=repo, SEQUOIA_TORCH="torch==2.13.0+cpu").returncode == 0  # another build, asked for
    assert any("torch==2.13.0+cpu" in c for c in pip_installs())
    assert run(setup, cwd=repo).returncode == 0
    assert pip_installs() == []


def test_a_full_disk_is_named_and_no_other_index_is_tried(repo):
    """CI's stop 67 failed on a machine whose disk was full: setup.sh said torch was not on the package index, tried
    PyTorch's own index (unreachable there), and left the reason to the last lines of pip's log. 200 kB of log
    after the message: a ``tail | grep -q`` under pipefail missed it (grep quits, tail gets SIGPIPE)."""
    python = repo / ".venv" / "bin" / "python"
    python.write_text(STUB.format(log=repo.parent / "calls.log") + 'case "$*" in *"-m pip"*" install "*)\n'
                      '  echo "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device"'
                      '\n  head -c 200000 /dev/zero | tr "\\0" x; echo\n  exit 1;; esac\n')  # pip's log goes on
    out = run(repo / "scripts" / "setup.sh", cwd=repo)
    assert out.returncode == 1, out.stderr
    assert "the disk is full" in out.stderr and "Avail" in out.stderr, out.stderr  # df's table: what is free where
    assert "not on the configured package index" not in out.stderr, out.stderr
    installs = [c for c in calls(repo) if "-m pip" in c and " install " in c]
    assert len(installs) == 1 and "download.pytorch.org" not in installs[0], installs
    assert not (repo / ".venv" / ".sequoia-ray-installed").exists()


def test_a_missing_wheel_still_tries_the_cpu_index(repo):
    """A first install that fails for another reason (the wheel is not where pip looks) goes on to PyTorch's index."""
    python = repo / ".venv" / "bin" / "python"
    python.write_text(STUB.format(log=repo.parent / "calls.log") + 'case "$*" in *download.pytorch.org*) ;;\n'
                      '  *"-m pip"*" install "*torch*) echo "ERROR: No matching distribution found"; exit 1;; esac\n')
    out = run(repo / "scripts" / "setup.sh", cwd=repo)
    assert out.returncode == 0, out.stderr
    assert "not on the configured package index" in out.stderr and "disk is full" not in out.stderr
    installs = [c for c in calls(repo) if "-m pip" in c and " install " in c]
    assert "download.pytorch.org" in installs[1], installs
