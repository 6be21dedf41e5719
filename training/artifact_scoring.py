"""Score multiple-choice questions offline exactly as the gateway serves an artifact: the base weights with the
artifact's LoRA adapter merged in, the artifact's answer format (letter or cloze) and its α head.

It runs the training code's answer formats over the whole model (no frozen prefix: the first trained layer is 0), so
training, `calm eval` and the gateway score by one rule; a test checks these probabilities against the gateway's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from calm_core.alpha_head import AlphaHead
from calm_core.artifact import LoadedArtifact, load_artifact
from calm_core.scoring import option_probs
from calm_core.data import MCQuestion
from calm_core.hashing import vocab_sha256
from calm_core.prompts import AnswerFormatName
from training.alpha_params import AlphaParams
from training.answer_formats import answer_format
from training.artifacts import output_vocab_size


def load_verified_artifact(path: str | Path, model_path: str, tokenizer) -> LoadedArtifact:
    """The artifact, refused with a one-line error unless it fits this model's vocabulary and tokenizer (checked
    before any weights load: a mismatch should fail in a second, not a minute)."""
    return load_artifact(path, expect_vocab_size=output_vocab_size(model_path),
                         expect_tokenizer_sha256=vocab_sha256(tokenizer.get_vocab()))


def load_served_model(model_path: str, adapter_dir: Path | None, dtype: str = "float32"):
    """The model the gateway runs for multiple choice: base weights, plus the artifact's adapter merged if it has one."""
    from training.scoring import load_causal_lm

    model = load_causal_lm(model_path, dtype)
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()


@torch.inference_mode()
def option_probabilities(model, tokenizer, questions: list[MCQuestion], format_name: AnswerFormatName,
                         head: AlphaHead | None, batch_size: int = 8,
                         progress: Callable[[int], None] | None = None) -> np.ndarray:
    """(N, max options) each question's distribution over its options (padding columns 0), through the α head."""
    fmt = answer_format(format_name, tokenizer)
    vocab = model.get_output_embeddings().weight.shape[0]
    alpha = AlphaParams.from_head(head if head is not None else AlphaHead.identity(vocab))
    width = max(q.n_options for q in questions)
    scores = np.zeros((len(questions), width), dtype=np.float64)
    order = sorted(range(len(questions)), key=lambda i: len(fmt.fingerprint(tokenizer, questions[i])))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        items = fmt.encode(model, tokenizer, [questions[i] for i in idx], 0, batch_size)
        raw = fmt.forward(model, items, 0, width, torch.device("cpu"))
        scores[idx] = fmt.option_logits(raw, alpha).double().numpy()
        if progress is not None:
            progress(len(idx))
    return option_probs(scores, np.asarray([q.n_options for q in questions]))
