"""What LoRA costs a CPU engine's forward pass per decoder layer, with vLLM's CPU fallback ops and with CALM's
(adapters/vllm_plugins/cpu_lora.py), side by side in one process on one core.

    python benchmarks/engines/bench_cpu_lora.py [--out benchmarks/results]

Driven through vLLM's own CPU Punica wrapper (`add_lora_linear`, as its LoRA layers call it) at the embedded model's
shapes (hidden 576, q 576, k/v 192, MLP 1536) and a multi-LoRA engine's rank room (64, 4 slots, what CALM's engines
configure: adapters/vllm_plugins/common.py). A layer is its four LoRA projections (qkv, o, gate/up, down); milliseconds
per layer, the median of 5 interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

HIDDEN, KV, MLP, RANK, SLOTS = 576, 192, 1536, 64, 4
PROJECTIONS = {"qkv": (HIDDEN, (HIDDEN, KV, KV)), "o": (HIDDEN, (HIDDEN,)), "gate_up": (HIDDEN, (MLP, MLP)),
               "down": (MLP, (HIDDEN,))}
# (requests, tokens each, adapters among them). vLLM's CPU runner marks every batch a prefill (its LoRA mixin), so a
# decode step is one token per request through the same `sgmv_*` path.
BATCHES = {"decode, 8 requests on 1 adapter": (8, 1, 1), "decode, 8 requests on 2 adapters": (8, 1, 2),
           "prefill, 1 x 16 tokens": (1, 16, 1), "prefill, 1 x 128 tokens": (1, 128, 1),
           "prefill, 4 x 128 tokens, 2 adapters": (4, 128, 2)}


def ops_modules():
    from adapters.vllm_plugins import cpu_lora

    return {"vLLM": cpu_lora.vllms_ops(), "CALM": cpu_lora}


def use(ops) -> None:
    from adapters.vllm_plugins.cpu_lora import _PARAMETERS, holders

    for module in holders():
        for name in _PARAMETERS:
            setattr(module, name, getattr(ops, name))


def layer_call(requests: int, tokens: int, adapters: int):
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    wrapper = PunicaWrapperCPU(max_num_batched_tokens=4096, max_batches=64, device="cpu")
    ids = [1 + r % adapters for r in range(requests)]
    per_token = tuple(i for i in ids for _ in range(tokens))
    wrapper.update_metadata(LoRAMapping(index_mapping=per_token, prompt_mapping=tuple(ids), is_prefill=True),
                            [1, 2, None, None], SLOTS, 49152)
    g = torch.Generator().manual_seed(0)
    n = requests * tokens
    projections = []
    for inner, slices in PROJECTIONS.values():
        a = tuple(torch.randn(SLOTS, 1, RANK, inner, generator=g) * 0.01 for _ in slices)
        b = tuple(torch.randn(SLOTS, 1, out, RANK, generator=g) * 0.01 for out in slices)
        projections.append((torch.randn(n, inner, generator=g), torch.zeros(n, sum(slices)), a, b, slices))

    def call() -> None:
        for x, y, a, b, slices in projections:
            wrapper.add_lora_linear(y, x, a, b, 1.0, slices)

    return call, projections


def timed(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    modules = ops_modules()
    rows = []
    for label, shape in BATCHES.items():
        call, projections = layer_call(*shape)
        outputs, ms = {}, {name: [] for name in modules}
        for name, ops in modules.items():  # same numbers first (the tokens all have adapters here)
            use(ops)
            for _, y, *_ in projections:
                y.zero_()
            call()
            outputs[name] = [y.clone() for _, y, *_ in projections]
        for got, expected in zip(outputs["CALM"], outputs["vLLM"]):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        calls = max(1, 200 // (shape[0] * shape[1]))
        for _ in range(args.repeats):
            for name, ops in modules.items():
                use(ops)
                ms[name].append(timed(call, calls))
        vllm_ms, calm_ms = statistics.median(ms["vLLM"]), statistics.median(ms["CALM"])
        rows.append({"batch": label, "tokens": shape[0] * shape[1], "vllm_ms": round(vllm_ms, 3),
                     "calm_ms": round(calm_ms, 3), "ratio": round(vllm_ms / calm_ms, 1)})
        print(rows[-1], flush=True)
    use(modules["CALM"])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_lora.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["# LoRA per decoder layer on one CPU core: vLLM's CPU fallback ops and CALM's "
             "(`python benchmarks/engines/bench_cpu_lora.py`)", "",
             f"The embedded model's shapes, rank room {RANK}, {SLOTS} slots; through vLLM's PunicaWrapperCPU; median of "
             f"{args.repeats} interleaved repeats; the same numbers checked first (1e-5).", "",
             "| batch | tokens | vLLM (ms/layer) | CALM (ms/layer) | vLLM / CALM |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['tokens']} | {r['vllm_ms']} | {r['calm_ms']} | {r['ratio']} |" for r in rows]
    (args.out / "cpu_lora.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
