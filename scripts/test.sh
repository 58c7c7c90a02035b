#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite: unit, integration (local Ray, tiny models) and slow
# (the real model pair), on two pytest-xdist workers (SEQUOIA_TEST_WORKERS; 0 runs in this process). Extra
# arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -n "${SEQUOIA_TEST_WORKERS:-2}" "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$code"
