#!/usr/bin/env bash
# The project's test command (README, `make test`, .ci/run): everything, the slow end-to-end tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CALM_HOME=${CALM_HOME:-$PWD/.calm}
export HF_HUB_OFFLINE=1

# The alerting and retraining-loop tests run a real Prometheus and a real Alertmanager: Debian's packages (servers,
# promtool, amtool).
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing Debian's prometheus and prometheus-alertmanager packages for the alerting tests"
  $SUDO apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq prometheus prometheus-alertmanager >/dev/null; }
fi

# The store tests run the same cases on SQLite and on a real PostgreSQL server: Debian's package (tests/postgres.py
# starts a throwaway cluster on loopback).
if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing Debian's postgresql package for the store tests"
  $SUDO apt-get install -y -qq postgresql >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq postgresql >/dev/null; }
fi

# The fleet test balances two gateway replicas and two engines with HAProxy (deploy/haproxy/haproxy.cfg).
if ! command -v haproxy >/dev/null && [ ! -x /usr/sbin/haproxy ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing Debian's haproxy package for the fleet test"
  $SUDO apt-get install -y -qq haproxy >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq haproxy >/dev/null; }
fi

# `calm engine` and the fleet's stock engines preload tcmalloc (adapters/hosting/allocator.py; vLLM's CPU backend asks for it).
if ! "$VENV/bin/python" -c "import sys; from adapters.hosting.allocator import tcmalloc_library; sys.exit(not tcmalloc_library())"; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "installing Debian's libtcmalloc-minimal4 package for the engine servers"
  $SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }
fi

"$VENV/bin/calm" model prepare
# How much memory this machine gives at full speed right now (~10 s): on the CI-kind VMs memory the host no longer
# backs is ~25x slower to touch, and a run that needs more than the probe found is slower for it
# (docs/retraining-loop.md, hot swap).
CALM_FAST_MEMORY=$("$VENV/bin/python" scripts/memory_ceiling.py --step-gb 0.5 | tail -1) || CALM_FAST_MEMORY=""
echo "$CALM_FAST_MEMORY"
export CALM_FAST_MEMORY  # repeated in the memory table at the end (tests/conftest.py)
# Which CPU the run got (~1 s): the same suite took 15-20 min of tests on some 2-core machines and 64-74 on others.
CALM_MACHINE=$("$VENV/bin/python" scripts/machine_probe.py | tail -1) || CALM_MACHINE=""
echo "$CALM_MACHINE"
export CALM_MACHINE  # repeated above the time table at the end (tests/conftest.py)
# LiteLLM's proxy (the test of calibration headers behind it) has a venv of its own; its install overlaps the first
# tests, and the test waits for it on a file lock (tests/litellm_proxy.py).
mkdir -p "$CALM_HOME"
"$VENV/bin/python" -m tests.litellm_proxy > "$CALM_HOME/litellm-install.log" 2>&1 &
# Where the time went, at the end of every run: pytest's 30 slowest steps, then tests/conftest.py's table per file and
# per test (setup + call + teardown), also written to $CALM_TEST_TIMES_OUT (benchmarks/results/test-times.md holds a published one).
export CALM_TEST_TIMES_OUT=${CALM_TEST_TIMES_OUT:-$CALM_HOME/test-times.md}
# Two files at a time (pytest-xdist, whole files per worker so a module's server starts once), the slowest files first
# (tests/conftest.py orders them; --no-loadscope-reorder keeps xdist from reordering by test count), each worker
# handed one file ahead at most (tests/file_schedule.py): most of a slow test is one engine's single thread, so the
# second core is otherwise idle.
# CALM_TEST_WORKERS=0 runs everything in this process.
exec "$VENV/bin/pytest" -q --durations=30 -n "${CALM_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
