#!/usr/bin/env bash
# The main job on the embedded default: set up (idempotent), then start the Sequoia service on local Ray
# (CPU, the default Qwen2.5-Coder 0.5B -> 1.5B pair, plans from the local store .sequoia/plans), send a real
# request, print the answer and the speedup, and keep serving at http://127.0.0.1:8000/v1 (Ctrl-C stops).
# When the store has no plan for this machine yet, the first run profiles it before serving (within
# --profile-seconds, default 120, after loading the models; a progress bar on a terminal), publishes the plans
# and serves them; if profiling cannot give a plan, the built-in one is served and the reason printed.
# Pass --exit to stop after the demo, --no-profile to serve stored or built-in plans only; other flags go to
# `sequoia-ray serve` (see --help there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p .sequoia/plans
exec .venv/bin/sequoia-ray serve --demo "$@"
