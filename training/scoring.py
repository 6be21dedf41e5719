"""Loading Hugging Face models and tokenizers, and the last position's logits of a batch of prompts (an independent
full-model reference for tests; scoring itself goes through the scorers, training/artifact_scoring.py).

transformers is imported where a model or tokenizer is loaded: importing it costs seconds, and the CLI's commands that
load no model should not pay for it.

Only the last position's logits are computed (`logits_to_keep=1`): the full (batch, seq, vocab) tensor would cost
gigabytes.
"""

from __future__ import annotations

import torch

from calm_core.errors import ModelError


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise ModelError(f"cannot load tokenizer of {path!r}: {str(e).splitlines()[0]}") from None


def output_vocab_size(model_path: str) -> int:
    """Rows of the LM head: what the α head must cover (may exceed len(tokenizer) for padded vocabularies)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).vocab_size)


def load_causal_lm(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bars report the work that takes time
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except OSError as e:
        raise ModelError(f"cannot load model {path!r}: {str(e).splitlines()[0]}") from None
    return model.eval()


def load_hf_model(path: str, dtype: str = "float32"):
    """(model, tokenizer) from a local folder or hub id, in eval mode."""
    return load_causal_lm(path, dtype), load_tokenizer(path)


@torch.inference_mode()
def last_position_logits(model, tokenizer, prompts: list[str]) -> torch.Tensor:
    """(batch, vocab) logits at each prompt's last token, with left padding so the last column is the answer slot."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model(**enc, logits_to_keep=1)
    return out.logits[:, -1, :].float()
