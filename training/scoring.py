"""Letter-format scoring with Hugging Face transformers: the logits of the option letters A..M at the answer position.

Only the last position's logits are computed (`logits_to_keep=1`): the full (batch, seq, vocab) tensor would cost
gigabytes. Because the α head acts per token, the raw letter logits are enough to evaluate any head afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from calm_core.alpha_head import AlphaHead, apply_alpha, option_probs
from calm_core.data import MCQuestion
from calm_core.errors import ModelError
from calm_core.prompts import letter_prompt, letter_token_ids


@dataclass
class LetterScores:
    """Raw letter logits for a list of questions, plus what metrics need."""

    letter_logits: np.ndarray  # (N, 13) float64, logits of tokens A..M at the answer position
    letter_ids: np.ndarray  # (13,)
    n_options: np.ndarray  # (N,)
    labels: np.ndarray  # (N,)
    question_ids: list[str]
    domains: list[str]

    def probs(self, head: AlphaHead | None = None) -> np.ndarray:
        """Distribution over each question's options, optionally through an α head.

        Columns run to the largest option count in the set (rows with fewer options are padded with zeros), so
        class-wise metrics average over real classes only.
        """
        width = int(self.n_options.max())
        logits, ids = self.letter_logits[:, :width], self.letter_ids[:width]
        if head is not None:
            d, l = head.rows(ids)
            logits = apply_alpha(logits, d.astype(np.float64), l.astype(np.float64))
        return option_probs(logits, self.n_options)

    def save(self, path: str | Path) -> None:
        np.savez_compressed(
            path,
            letter_logits=self.letter_logits,
            letter_ids=self.letter_ids,
            n_options=self.n_options,
            labels=self.labels,
            question_ids=np.asarray(self.question_ids),
            domains=np.asarray(self.domains),
        )


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise ModelError(f"cannot load tokenizer of {path!r}: {str(e).splitlines()[0]}") from None


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


def score_letters(
    model,
    tokenizer,
    questions: list[MCQuestion],
    batch_size: int = 16,
    description: str = "scoring",
    show_progress: bool = True,
) -> LetterScores:
    letter_ids = np.asarray(letter_token_ids(tokenizer), dtype=np.int64)
    prompts = [letter_prompt(tokenizer, q) for q in questions]
    # Length-sorted batches waste little on padding; results go back to the input order.
    order = np.argsort([len(p) for p in prompts], kind="stable")
    letter_logits = np.zeros((len(questions), len(letter_ids)), dtype=np.float64)
    ids_t = torch.as_tensor(letter_ids)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        disable=not show_progress, transient=True,
    ) as progress:
        task = progress.add_task(description, total=len(questions))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            logits = last_position_logits(model, tokenizer, [prompts[i] for i in idx])
            letter_logits[idx] = logits[:, ids_t].double().numpy()
            progress.advance(task, len(idx))
    return LetterScores(
        letter_logits=letter_logits,
        letter_ids=letter_ids,
        n_options=np.asarray([q.n_options for q in questions]),
        labels=np.asarray([q.answer for q in questions]),
        question_ids=[q.id for q in questions],
        domains=[q.domain for q in questions],
    )
