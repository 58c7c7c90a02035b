#!/usr/bin/env bash
# Check sequoia-ray on this machine's GPU, end to end. Run it on a machine with an NVIDIA GPU:
#
#   bash scripts/gpu_check.sh [--quick]
#
# 1. Set up .venv (scripts/setup.sh) with SEQUOIA_TORCH (default torch==2.13.0). On a Linux GPU machine
#    PyPI's torch wheel is the CUDA build; to pick another build (another CUDA version, a mirror) set
#    SEQUOIA_TORCH_PIP_ARGS to the pip options that select it (e.g. an --index-url).
#    (setup.sh is idempotent: it reinstalls only when the torch spec or pyproject.toml changed.)
# 2. pytest -m gpu tests/gpu: the tiny pair on CUDA (greedy == target alone in fp32, same seed -> same tokens,
#    model / KV cache / generators where they belong, a bf16 draft) and
#    tests/gpu/test_tp_nccl.py (TP 2 over NCCL == TP 1; needs 2 GPUs), tests/gpu/test_tp_gloo_on_gpu_node.py
#    (a CPU target's gloo ranks stay on the CPU of a GPU node).
# 3. Greedy identity on the real pair (fp32, on the GPU): speculative output == the target alone.
# 4. A speedup table on the real pair (bfloat16): benchmarks/e2e.py --device cuda. --quick shortens it.
# Without a GPU it says so and stops (exit code 2) after step 1.
set -euo pipefail
USAGE="usage: bash scripts/gpu_check.sh [--quick]"
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    -h | --help) echo "$USAGE"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$arg'; $USAGE" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
export SEQUOIA_TORCH=${SEQUOIA_TORCH:-torch==2.13.0}  # setup.sh remembers it: main.sh and test.sh keep this build
export SEQUOIA_TORCH_PIP_ARGS=${SEQUOIA_TORCH_PIP_ARGS:-}
PY=.venv/bin/python

echo "== 1/4 setup ($SEQUOIA_TORCH $SEQUOIA_TORCH_PIP_ARGS)"
bash scripts/setup.sh
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -c "import torch; print(f'torch {torch.__version__}, CUDA build: {torch.version.cuda}')"
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
      && "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 1)"; then
    echo "gpu_check: nvidia-smi sees a GPU but .venv holds a CPU build of torch (setup.sh keeps an existing" >&2
    echo "gpu_check: install); replace it with:" >&2
    echo "  $PY -m pip install --force-reinstall \"$SEQUOIA_TORCH\" $SEQUOIA_TORCH_PIP_ARGS" >&2
  fi
  echo "gpu_check: NO GPU FOUND - torch sees no CUDA device (no NVIDIA driver / GPU, or a CPU build of torch:" >&2
  echo "gpu_check: set SEQUOIA_TORCH_PIP_ARGS to a CUDA wheel index). Nothing was tested on a GPU." >&2
  exit 2
fi
"$PY" -c "import torch; print('GPU:', ', '.join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))"

echo "== 2/4 pytest -m gpu tests/gpu"
"$PY" -m pytest -m gpu -q tests/gpu

echo "== 3/4 greedy identity on the real pair (float32, cuda)"
PROMPT="def fibonacci(n):"
gen() { .venv/bin/sequoia-ray generate --device cuda --dtype float32 --prompt "$PROMPT" --max-tokens 64 --json "$@"; }
spec=$(gen | "$PY" -c "import json, sys; print(json.load(sys.stdin)['token_ids'])")
alone=$(gen --no-speculation | "$PY" -c "import json, sys; print(json.load(sys.stdin)['token_ids'])")
if [ "$spec" != "$alone" ]; then
  echo "gpu_check: FAIL - speculative greedy output differs from the target alone" >&2
  echo "  speculative: $spec" >&2
  echo "  target:      $alone" >&2
  exit 1
fi
echo "greedy identity: OK (64 tokens)"

echo "== 4/4 speedup table on the real pair (bfloat16, cuda)"
if [ "$QUICK" = 1 ]; then
  "$PY" benchmarks/e2e.py --device cuda --dtype bfloat16 --limit 2 --max-tokens 32 --temperatures 0
else
  "$PY" benchmarks/e2e.py --device cuda --dtype bfloat16
fi
echo "gpu_check: all GPU checks passed"
