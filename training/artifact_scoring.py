"""Score multiple-choice questions offline exactly as the gateway serves an artifact: the base weights with the
artifact's LoRA adapter merged in, the artifact's answer format (letter or cloze) and its α head, through the
gateway's scorers (calm_core/scorers/) on the offline engine (training/offline_engine.py).

Training, `calm eval`, the reports and the retraining gate score by this one path; a test checks it against the
gateway's answers to the same questions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np

from calm_core.alpha_head import AlphaHead
from calm_core.artifact import LoadedArtifact, load_artifact
from calm_core.data import MCQuestion
from calm_core.hashing import vocab_sha256
from calm_core.prompts import AnswerFormat
from calm_core.scorers.base import PostHoc
from calm_core.scorers.questions import option_matrix, score_options
from training.offline_engine import OfflineEngine
from training.scoring import load_causal_lm, output_vocab_size


def load_verified_artifact(path: str | Path, model_path: str, tokenizer) -> LoadedArtifact:
    """The artifact, refused with a one-line error unless it fits this model's vocabulary and tokenizer (checked
    before any weights load: a mismatch should fail in a second, not a minute)."""
    return load_artifact(path, expect_vocab_size=output_vocab_size(model_path),
                         expect_tokenizer_sha256=vocab_sha256(tokenizer.get_vocab()))


def load_served_model(model_path: str, adapter_dir: Path | None, dtype: str = "float32"):
    """The model the gateway runs for multiple choice: base weights, plus the artifact's adapter merged if it has one."""
    model = load_causal_lm(model_path, dtype)
    if adapter_dir is None:
        return model
    from peft import PeftModel  # heavy, and needed only for artifacts that carry an adapter

    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()


def option_probabilities(model, tokenizer, questions: list[MCQuestion], format_name: AnswerFormat,
                         head: AlphaHead | None, batch_size: int = 8,
                         progress: Callable[[int], None] | None = None, option_temperature: float = 1.0) -> np.ndarray:
    """(N, max options) each question's distribution over its options (padding columns 0), through the α head and a
    recalibrated version's option temperature."""
    engine = OfflineEngine(model, tokenizer, head, batch_size)
    return option_matrix(asyncio.run(score_options(engine, tokenizer, questions, format_name, progress=progress,
                                                   post_hoc=PostHoc(option_temperature))))
