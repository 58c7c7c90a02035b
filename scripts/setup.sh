#!/usr/bin/env bash
# Create or reuse .venv and install the project into it. Idempotent: a second run with an unchanged
# pyproject.toml does nothing. torch is installed first as the CPU build: a bare `torch` from PyPI pulls
# a multi-GB CUDA build. Override with SEQUOIA_TORCH="torch==X" / SEQUOIA_TORCH_PIP_ARGS="--index-url ...".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${SEQUOIA_TORCH:-torch==2.13.0}
VENV=.venv
STAMP=$VENV/.sequoia-ray-installed

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
want="$(cat pyproject.toml "$0" | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
LOG=$VENV/setup.log
pip() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" >>"$LOG" 2>&1 \
    || { echo "setup: 'pip install $*' failed; the log is $LOG:" >&2; tail -20 "$LOG" >&2; exit 1; }
}
echo "setup: installing $TORCH_SPEC (CPU build) and sequoia-ray into $VENV ..." >&2
pip install "$TORCH_SPEC" ${SEQUOIA_TORCH_PIP_ARGS:-}
pip install -e ".[dev]"
"$VENV/bin/python" -c "import sequoia_ray, actors, deployments.app, cli.main, ray, transformers" || { echo "setup: install failed" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "setup: done; the CLI is $VENV/bin/sequoia-ray" >&2
