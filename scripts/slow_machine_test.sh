#!/usr/bin/env bash
# The fault and timing tests on a machine made slow on purpose: one busy process per core (plain Python loops at the
# tests' own priority) for the whole run. Every such test waits for events, not for fixed times, so it must pass here.
#   bash scripts/slow_machine_test.sh            # the default list below
#   bash scripts/slow_machine_test.sh tests/test_faults.py
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=("$@")
[ ${#TESTS[@]} -gt 0 ] || TESTS=(tests/test_upstream.py tests/test_faults.py tests/test_limits.py tests/test_loop_api.py
  tests/test_contract.py tests/test_client_keys.py tests/test_store.py tests/test_retrain_loop.py
  "tests/test_gateway_logic.py::test_group_commit_writes_a_burst_in_few_transactions_and_fails_every_caller_of_a_failed_one")
busy=()
for _ in $(seq 1 "$(nproc)"); do
  python3 -c 'while True: pass' &
  busy+=($!)
done
trap 'kill "${busy[@]}" 2>/dev/null' EXIT
echo "$(nproc) busy processes: ${busy[*]}"
start=$(date +%s)
LOG=${LOG:-/tmp/calm-slow-machine.log}
bash scripts/test.sh -p no:cacheprovider "${TESTS[@]}" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
seconds=$(( $(date +%s) - start ))
echo "slow-machine run: exit $rc after $seconds s with $(nproc) busy processes"
# One row per run in benchmarks/results/slow-machine.md (docs/testing.md's copy: scripts/readme_numbers.py).
OUT=benchmarks/results/slow-machine.md
[ -f "$OUT" ] || printf '| date (UTC) | commit | tests | result | seconds |\n|---|---|---|---|---:|\n' > "$OUT"
summary=$(grep -E '^=+ .*(passed|failed|error).* in |^[0-9]+ (passed|failed)' "$LOG" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
printf '| %s | %s | %s | %s (exit %d) | %d |\n' "$(date -u +%F\ %H:%M)" "$(git rev-parse --short HEAD)" \
  "$(echo "${TESTS[@]}" | sed 's/tests\///g; s/::test_group_commit[a-z_]*/::group_commit/')" "$summary" "$rc" "$seconds" >> "$OUT"
exit $rc
