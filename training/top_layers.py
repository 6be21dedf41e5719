"""Training only the top layers, with the frozen bottom computed once.

LoRA sits on the top `k` decoder layers only, so for a fixed prompt the hidden states entering layer L−k never
change during training: they are computed once per prompt (`encode_prefix`), kept, and every training or evaluation
step runs just the top layers (`last_logits`). The backward pass stops there as well. Numerically this equals the
full model's forward (a test checks it), at k/L of the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.masking_utils import create_causal_mask


@dataclass
class PrefixBatch:
    hidden: torch.Tensor  # (B, T, H) left-padded hidden states entering the first trained layer
    mask: torch.Tensor  # (B, T) 1 for real tokens

    def to(self, device) -> "PrefixBatch":
        return PrefixBatch(self.hidden.to(device), self.mask.to(device))


def decoder(model):
    """The LlamaModel-like stack inside a causal LM, with or without a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.lm_head


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _run_layers(stack, layers, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    position_ids = _positions(mask)
    causal = create_causal_mask(config=stack.config, inputs_embeds=hidden, attention_mask=mask,
                                past_key_values=None, position_ids=position_ids)
    return run_layers_masked(stack, layers, hidden, causal, position_ids)


def run_layers_masked(stack, layers, hidden: torch.Tensor, mask4d: torch.Tensor | None,
                      position_ids: torch.Tensor) -> torch.Tensor:
    """Decoder layers under an explicit attention mask (None, or (B, 1, T, T) with True = attend) and position ids."""
    position_embeddings = stack.rotary_emb(hidden, position_ids=position_ids)
    for layer in layers:
        hidden = layer(hidden, attention_mask=mask4d, position_embeddings=position_embeddings, position_ids=position_ids)
    return hidden


@torch.inference_mode()
def encode_prefix(model, tokenizer, prompts: list[str], first_trained: int, batch_size: int = 16,
                  progress=None) -> list[torch.Tensor]:
    """Hidden states entering layer `first_trained` for each prompt, unpadded: a list of (T_i, H) tensors."""
    stack, _ = decoder(model)
    tokenizer.padding_side = "left"
    out: list[torch.Tensor | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
        hidden = stack.embed_tokens(enc["input_ids"])
        hidden = _run_layers(stack, stack.layers[:first_trained], hidden, enc["attention_mask"])
        for row, i in enumerate(idx):
            n = int(enc["attention_mask"][row].sum())
            out[i] = hidden[row, -n:].clone()
        if progress is not None:
            progress(len(idx))
    return out  # type: ignore[return-value]


def collate(hidden: list[torch.Tensor]) -> PrefixBatch:
    """Left-pad a list of (T_i, H) tensors so the last column is every prompt's answer position."""
    length = max(h.shape[0] for h in hidden)
    batch = hidden[0].new_zeros((len(hidden), length, hidden[0].shape[1]))
    mask = torch.zeros((len(hidden), length), dtype=torch.long)
    for row, h in enumerate(hidden):
        batch[row, length - h.shape[0] :] = h
        mask[row, length - h.shape[0] :] = 1
    return PrefixBatch(batch, mask)


def last_logits(model, batch: PrefixBatch, first_trained: int, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits at the answer position from the top layers: (B, V), or (B, len(token_ids)) for just those tokens."""
    stack, lm_head = decoder(model)
    hidden = _run_layers(stack, stack.layers[first_trained:], batch.hidden, batch.mask)
    last = stack.norm(hidden[:, -1, :])
    if token_ids is None:
        return lm_head(last)
    return last @ lm_head.weight[token_ids].T


def enable_checkpointing(model, first_trained: int) -> None:
    """The trained layers recompute their activations in the backward pass (transformers' own per-layer checkpointing,
    which applies to a layer in training mode; Llama-like layers have no dropout, so the mode changes nothing else)."""
    stack, _ = decoder(model)
    stack.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in stack.layers[first_trained:]:
        layer.train()
