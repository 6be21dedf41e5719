"""What `calm train` keeps for the backward pass, measured per token and trained layer, and the GPU memory plan for a
7-8B model with LoRA computed from it (docs/training.md).

Measured (on any machine, CPU included): the bytes autograd saves for one trained decoder layer with LoRA r=16 on all
seven linear modules (torch.autograd.graph.saved_tensors_hooks), per token, with and without gradient checkpointing, for
the embedded model's layer and for a layer of Llama-3-8B's shape (random weights: no download; bf16, as
`dtype = "bfloat16"` trains). Computed from those: the memory of a training step of the 8B model on one GPU, frozen
weights in bf16, for the top 4 layers trained (the trainer's default) and for all 32.

    python benchmarks/loop/bench_training_memory.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

GiB = 1024**3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 num_hidden_layers=32, vocab_size=128256, tie_word_embeddings=False)


def layer_params(c) -> int:
    head_dim = c.hidden_size // c.num_attention_heads
    attention = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * c.num_key_value_heads * head_dim
    return attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size


def lora_params(c, rank: int) -> int:
    head_dim = c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    shapes = [(c.hidden_size, c.hidden_size), (c.hidden_size, kv), (c.hidden_size, kv), (c.hidden_size, c.hidden_size),
              (c.hidden_size, c.intermediate_size), (c.hidden_size, c.intermediate_size),
              (c.intermediate_size, c.hidden_size)]
    return rank * sum(i + o for i, o in shapes)


def saved_bytes_per_token(config, dtype: torch.dtype, tokens: int, checkpointing: bool) -> float:
    """Bytes autograd keeps for one LoRA-trained layer's backward pass, per token of a batch of one."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS),
                                    LlamaDecoderLayer(config, layer_idx=0).to(dtype))
    for name, p in layer.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:  # not the zero start: every path of the backward pass is live
            torch.nn.init.normal_(p, std=1e-3)
    hidden = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)  # a layer above another
    positions = torch.arange(tokens)[None]
    rotary = LlamaRotaryEmbedding(config)(hidden, positions)
    kept = []
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def keep(t):  # the weights a matmul keeps for its backward pass are no new memory
        if t.untyped_storage().data_ptr() not in weights:
            kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        if checkpointing:
            out = torch.utils.checkpoint.checkpoint(layer, hidden, position_embeddings=rotary, position_ids=positions,
                                                    attention_mask=None, use_reentrant=False)
        else:
            out = layer(hidden, position_embeddings=rotary, position_ids=positions, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
    out.float().pow(2).mean().backward()
    return sum(kept) / tokens


def measure(configs: dict, tokens: tuple[int, ...]) -> list[dict]:
    rows = []
    for name, (config, dtype) in configs.items():
        for checkpointing in (False, True):
            per_token = [saved_bytes_per_token(config, dtype, t, checkpointing) for t in tokens]
            rows.append(dict(model=name, dtype=str(dtype).removeprefix("torch."), checkpointing=checkpointing,
                             per_token={t: b for t, b in zip(tokens, per_token)}))
            print(rows[-1], flush=True)
    return rows


def plan(config, kept: dict[bool, float], batch: int, tokens: int, trained: int, answer_tokens: int) -> dict:
    """GiB of one training step on one GPU: frozen weights bf16; LoRA, α and Adam state float32 (param, grad, 2
    moments); activations of the trained layers as measured (checkpointing keeps each layer's input and recomputes one
    layer at a time); the calibrated logits of the answer tokens, float32, with their log-softmax kept for backward."""
    params = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    params += config.num_hidden_layers * layer_params(config)
    n = batch * tokens
    out = {"frozen weights (bf16)": 2 * params / GiB,
           "LoRA + Adam (fp32)": 16 * trained * lora_params(config, 16) / GiB,
           "α head + Adam (fp32)": 16 * 2 * config.vocab_size / GiB,
           "logits of answer tokens": 2 * 4 * batch * answer_tokens * config.vocab_size / GiB}
    for checkpointing, per_token in kept.items():
        layers = trained * per_token * n if not checkpointing else (trained - 1) * per_token * n + kept[False] * n
        out[f"activations, {trained} layers, checkpointing {'on' if checkpointing else 'off'}"] = layers / GiB
    return out


def write(rows: list[dict], plans: dict, tokens: tuple[int, ...], out: Path) -> None:
    lines = [f"`python benchmarks/loop/bench_training_memory.py --out {out}`: bytes autograd keeps per token for one "
             "LoRA-trained decoder layer (r=16, all 7 linear modules), batch of 1.", "",
             "| layer of | dtype | checkpointing | " + " | ".join(f"KB/token at {t} tokens" for t in tokens) + " |",
             "|---|---|---|" + "---:|" * len(tokens)]
    for r in rows:
        values = " | ".join(f"{r['per_token'][t] / 1024:.1f}" for t in tokens)
        lines.append(f"| {r['model']} | {r['dtype']} | {'on' if r['checkpointing'] else 'off'} | {values} |")
    for title, parts in plans.items():
        lines += ["", f"**{title}** (GiB, computed from the measured bf16 rows)", "", "| part | GiB |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in parts.items()]
    (out / "training_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    from transformers import AutoConfig, LlamaConfig

    from calm_core.models import prepare_embedded

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 256])
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    embedded = AutoConfig.from_pretrained(prepare_embedded("float32"))
    big = LlamaConfig(**LLAMA3_8B)
    tokens = tuple(args.tokens)
    rows = measure({"SmolLM2-135M (embedded)": (embedded, torch.float32),
                    "Llama-3-8B shape": (big, torch.bfloat16)}, tokens)
    kept = {r["checkpointing"]: r["per_token"][tokens[-1]] for r in rows if r["model"] == "Llama-3-8B shape"}
    plans = {f"Llama-3-8B, batch 8 x 512 tokens, top {k} layers trained": plan(big, kept, 8, 512, k, 64)
             for k in (4, 32)}
    for parts in plans.values():
        parts["total, checkpointing off"] = sum(v for p, v in parts.items() if "checkpointing on" not in p)
        parts["total, checkpointing on"] = sum(v for p, v in parts.items()
                                               if "checkpointing off" not in p and not p.startswith("total"))
    args.out.mkdir(parents=True, exist_ok=True)
    write(rows, plans, tokens, args.out)


if __name__ == "__main__":
    main()
