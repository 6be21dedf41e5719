#!/usr/bin/env bash
# Seconds from launching `calm serve` (the default: embedded model, shipped artifact, 3 engines) to its first 200 on
# /health, then one multiple-choice answer. Run it on two checkouts to compare their start-ups on one machine.
#   bash benchmarks/engines/startup_time.sh [runs]
set -uo pipefail
cd "$(dirname "$0")/../.."
export CALM_HOME=${CALM_HOME:-$PWD/.calm} OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
for run in $(seq 1 "${1:-1}"); do
  port=$((20000 + RANDOM % 10000)); work=$(mktemp -d)
  t0=$(date +%s.%N)
  # Its own session, so that the whole group (gateway and engine processes) can be stopped at the end.
  setsid bash -c "echo \$\$ > $work/pid; exec .venv/bin/calm serve --port $port" > "$work/gateway.log" 2>&1 \
    < /dev/null &
  until [ -s "$work/pid" ]; do sleep 0.1; done
  pgid=$(cat "$work/pid")
  until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
    kill -0 "$pgid" 2> /dev/null || { echo "calm serve exited; log: $work/gateway.log"; exit 1; }
    sleep 0.5
  done
  t1=$(date +%s.%N)
  curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' -o /dev/null \
    -d '{"model":"calm-smollm2-135m","messages":[{"role":"user","content":"Which planet is largest?"}],"options":["Mars","Jupiter"]}' \
    || echo "the first answer failed"
  printf 'run %d: /health 200 after %.1f s\n' "$run" "$(echo "$t1 - $t0" | bc)"
  kill -TERM -- "-$pgid" 2> /dev/null
  for _ in $(seq 1 60); do kill -0 "$pgid" 2> /dev/null || break; sleep 0.5; done
  kill -KILL -- "-$pgid" 2> /dev/null
  rm -rf "$work"
done
