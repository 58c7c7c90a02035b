#!/usr/bin/env bash
# The main job on the embedded default: set up (idempotent), then plan the best Sequoia tree for the
# default acceptance vector and show it. (Serving on local Ray replaces this when deployments land.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p .sequoia/plans
.venv/bin/sequoia-ray plan --acceptance examples/acceptance-illustrative.json --budget 64 --max-depth 8 \
  --out .sequoia/plans/demo.json --plot .sequoia/plan.png "$@"
echo "plan file: .sequoia/plans/demo.json   picture: .sequoia/plan.png"
