#!/usr/bin/env bash
# The project's test command (README, `make test`, .ci/run): everything, the slow end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CALM_HOME=${CALM_HOME:-$PWD/.calm}
export HF_HUB_OFFLINE=1
"$VENV/bin/calm" model prepare
exec "$VENV/bin/pytest" -q "$@"
