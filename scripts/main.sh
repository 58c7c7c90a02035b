#!/usr/bin/env bash
# The main job on the embedded default: set up (idempotent), then start the Sequoia service on local Ray
# (CPU, the default Qwen2.5-Coder 0.5B -> 1.5B pair, plans from the local store .sequoia/plans), send a real
# request, print the answer and the speedup, and keep serving at http://127.0.0.1:8000/v1 (Ctrl-C stops).
# When the store has no plan for this machine yet, the first run profiles it before serving (within
# --profile-seconds, default 120, after loading the models; a progress bar on a terminal), publishes the plans
# and serves them; if profiling cannot give a plan, the built-in one is served and the reason printed.
# Pass --exit to stop after the demo, --no-profile to serve stored or built-in plans only; other flags go to
# `sequoia-ray serve` (see --help there). The service runs in the caller's folder, so relative paths given
# (--config my.yaml, --set plan_store=./plans) are the caller's; without --config the store is the repo's
# .sequoia/plans, wherever the script is run from.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
mkdir -p "$ROOT/.sequoia/plans"
store=(--set "plan_store=$ROOT/.sequoia/plans")  # the default config's relative store, made the repo's
for arg in "$@"; do
  case "$arg" in --config | --config=*) store=() ;; esac  # a config of the caller's: its store as it says
done
exec "$ROOT/.venv/bin/sequoia-ray" serve --demo "${store[@]}" "$@"
