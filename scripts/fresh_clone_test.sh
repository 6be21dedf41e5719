#!/usr/bin/env bash
# The README's two commands as a new user runs them: N fresh clones of this checkout's HEAD, one after the other, each
# `make setup` (the install), `make serve` until the gateway is ready (then stopped), then `make test`. Each run's wall
# time with and without the install goes to benchmarks/results/test-runs.md (the serve step's time is in the total and
# the result); the logs stay in $LOGS. SERVE_FIRST=0 skips `make serve`.
#   bash scripts/fresh_clone_test.sh 3
set -uo pipefail
N=${1:-3}
SRC=$(cd "$(dirname "$0")/.." && pwd)
PARENT=$(dirname "$SRC")  # clones sit beside the checkout: the tests read ../shared/data
OUT=${OUT:-$SRC/benchmarks/results/test-runs.md}
LOGS=${LOGS:-/tmp/calm-fresh-clone-runs}
mkdir -p "$LOGS" "$(dirname "$OUT")"
commit=$(git -C "$SRC" rev-parse --short HEAD)
[ -f "$OUT" ] || printf '| date (UTC) | commit | run | result | install (s) | tests (s) | total (min) |\n|---|---|---:|---|---:|---:|---:|\n' > "$OUT"
failed=0
for i in $(seq 1 "$N"); do
  dir="$PARENT/calm-fresh-clone-$i"
  rm -rf "$dir" && git clone -q "$SRC" "$dir"
  log="$LOGS/run-$i.log"
  t0=$(date +%s)
  make -C "$dir" setup > "$log" 2>&1
  t1=$(date +%s)
  served=""
  if [ "${SERVE_FIRST:-1}" = 1 ]; then
    # `make serve` as the README gives it (the model prepared into the clone's .calm, where `make test` then finds
    # it; a fresh HOME, so no cache of this machine's user helps), on a free port, until /health/ready answers or it
    # exits; then stopped as Ctrl-C would.
    port=${SERVE_PORT:-18000}
    setsid env HOME="$dir/.serve-home" CALM_PORT="$port" make -C "$dir" serve >> "$log" 2>&1 &
    serve_pid=$!
    ready=0
    for _ in $(seq 1 2400); do
      curl -sf "http://127.0.0.1:$port/health/ready" > /dev/null && { ready=1; break; }
      kill -0 "$serve_pid" 2> /dev/null || break
      sleep 1
    done
    kill -INT -- -"$serve_pid" 2> /dev/null; wait "$serve_pid" 2> /dev/null
    kill -KILL -- -"$serve_pid" 2> /dev/null  # whatever of its process group outlived it (engine processes)
    [ "$ready" = 1 ] || failed=1
    served="; make serve: $([ "$ready" = 1 ] && echo "ready after $(($(date +%s) - t1)) s" || echo "NOT READY")"
  fi
  t_tests=$(date +%s)
  make -C "$dir" test >> "$log" 2>&1
  rc=$?
  t2=$(date +%s)
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* in ' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  [ "$rc" -eq 0 ] || failed=1
  printf '| %s | %s | %d of %d | %s (exit %d%s) | %d | %d | %.1f |\n' "$(date -u +%F\ %H:%M)" "$commit" "$i" "$N" \
    "${summary:-no summary}" "$rc" "$served" $((t1 - t0)) $((t2 - t_tests)) "$(echo "($t2 - $t0) / 60" | bc -l)" | tee -a "$OUT"
  # The clone's time table (tests/conftest.py writes it through scripts/test.sh): the newest one is published beside $OUT.
  if [ -f "$dir/.calm/test-times.md" ]; then
    cp "$dir/.calm/test-times.md" "$LOGS/run-$i-times.md"
    { echo "From run $i of \`bash scripts/fresh_clone_test.sh $N\` at commit $commit on $(date -u +%F) ($(nproc) cores)."; echo
      cat "$dir/.calm/test-times.md"; } > "$(dirname "$OUT")/test-times.md"
  fi
  rm -rf "$dir"
done
exit $failed
