#!/usr/bin/env bash
# Create or reuse .venv and install the project into it. Idempotent: a second run with an unchanged
# pyproject.toml does nothing. torch is installed first, and as the CPU build by name (torch==2.13.0+cpu):
# a bare `torch` from PyPI is a multi-GB CUDA build on Linux. The CPU build comes from wherever pip finds it
# (a local wheel folder or index), else from PyTorch's CPU wheel index. Another build (a GPU machine: see
# scripts/gpu_check.sh): SEQUOIA_TORCH="torch==X" and SEQUOIA_TORCH_PIP_ARGS="<pip options>"; .venv remembers
# them, so a later run without them (scripts/main.sh, test.sh after gpu_check.sh) keeps that build instead of
# reinstalling the CPU one. pip installs without byte-compiling; one compileall on every core does it after (pip
# compiles on one: 152 -> 137 s here).
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # absolute: $0 may be relative to the folder left below
cd "$(dirname "$SELF")/.."
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
VENV=.venv
STAMP=$VENV/.sequoia-ray-installed
CHOSEN=$VENV/.sequoia-torch  # the SEQUOIA_TORCH and SEQUOIA_TORCH_PIP_ARGS last given, a line each

if [ -z "${SEQUOIA_TORCH:-}${SEQUOIA_TORCH_PIP_ARGS:-}" ] && [ -f "$CHOSEN" ]; then
  { read -r SEQUOIA_TORCH || true; read -r SEQUOIA_TORCH_PIP_ARGS || true; } < "$CHOSEN"
fi
TORCH_SPEC=${SEQUOIA_TORCH:-torch==2.13.0+cpu}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
want="$(cat pyproject.toml "$SELF" | sha256sum | cut -c1-16) $TORCH_SPEC ${SEQUOIA_TORCH_PIP_ARGS:-}"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
LOG=$VENV/setup.log
touch "$LOG"
disk_full() {  # the pip call that failed (the log past line $1) ran out of disk: say so and where, and stop
  awk -v from="$1" 'NR > from && /No space left on device/ { found = 1 } END { exit !found }' "$LOG" || return 0
  echo "setup: the disk is full (pip: 'No space left on device'). The install needs about 2.5 GB: $VENV about" \
    "2 GB (torch 0.75 GB of it, ray 0.25 GB), and pip unpacks wheels in ${TMPDIR:-/tmp} first. Free now:" >&2
  df -h "$VENV" "${TMPDIR:-/tmp}" >&2 || true
  echo "setup: free some space (or set TMPDIR to a folder on a larger disk) and run this again; the log is $LOG" >&2
  exit 1
}
pip() {
  local start
  start=$(wc -l < "$LOG")
  "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" >>"$LOG" 2>&1 \
    || { disk_full "$start"; echo "setup: 'pip $*' failed; the log is $LOG:" >&2; tail -20 "$LOG" >&2; exit 1; }
}
install_torch() {
  local start
  start=$(wc -l < "$LOG")
  if [ -n "${SEQUOIA_TORCH:-}${SEQUOIA_TORCH_PIP_ARGS:-}" ]; then
    pip install --no-compile "$TORCH_SPEC" ${SEQUOIA_TORCH_PIP_ARGS:-}
  elif ! "$VENV/bin/python" -m pip --disable-pip-version-check -q install --no-compile "$TORCH_SPEC" >>"$LOG" 2>&1; then
    disk_full "$start"  # not a missing wheel: another index would fail the same way
    echo "setup: $TORCH_SPEC is not on the configured package index; trying PyTorch's CPU wheel index" >&2
    pip install --no-compile "$TORCH_SPEC" --extra-index-url "$TORCH_CPU_INDEX"
  fi
}
echo "setup: installing $TORCH_SPEC and sequoia-ray into $VENV ..." >&2
install_torch
pip install --no-compile -e ".[dev]"
# a file that does not compile (some packages ship such test data) is skipped, as pip skips it. Not compiled
# (nothing here imports them; one that is imported is compiled in memory, as without compileall): packages'
# own tests and transformers' models other than the architectures loaded here (Qwen2, Llama; auto: the
# registries), a quarter of the .py bytes (the step took 38.5 -> 28.8 s here)
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VENV/bin/python" -m compileall -q -j 0 -x '/tests?/|/transformers/models/(?!(auto|qwen2|llama)/)' "$site" \
  >>"$LOG" 2>&1 || true
"$VENV/bin/python" -c "import sequoia_ray, actors, deployments.app, cli.main, ray, transformers" || { echo "setup: install failed" >&2; exit 1; }
echo "$want" > "$STAMP"
if [ -n "${SEQUOIA_TORCH:-}${SEQUOIA_TORCH_PIP_ARGS:-}" ]; then
  printf '%s\n%s\n' "${SEQUOIA_TORCH:-}" "${SEQUOIA_TORCH_PIP_ARGS:-}" > "$CHOSEN"
fi
echo "setup: done; the CLI is $VENV/bin/sequoia-ray" >&2
