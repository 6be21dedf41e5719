"""How a question and its answer become what training fits: option logits (multiple choice) or answer tokens (free form).

Three formats share one interface, so the trainer and its objectives do not know which is in use:

    letter  the options listed in the prompt, the answer is one letter; option logits are the calibrated logits of
            the letters A, B, ... at the answer position. (At 135M parameters this stays at chance.)
    cloze   the question alone, each option scored by the length-normalised log-likelihood of its text under the
            calibrated full-vocabulary distribution (training/cloze.py).
    generative  free-form: the question under the chat template, the answer's tokens generated after it; no options
            (training/generative.py).

`forward` runs the trained top layers (gradients flow to θ); `option_logits` and `token_entropy` apply α to what
forward returned, so the CALM step can reuse one detached forward at θ̃ with gradients flowing only to α.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from calm_core.alpha_head import apply_alpha
from calm_core.data import MCQuestion
from calm_core.prompts import AnswerFormat, cloze_option, cloze_prompt, cloze_tokens, letter_prompt, letter_token_ids
from training.alpha_params import AlphaParams
from training.generative import GenerativeFormat
from training.cloze import PackedQuestion, encode_packed, option_scores, pack_question, token_entropy, token_logits
from training.objectives import cross_entropy, entropy, mask_options
from training.top_layers import collate, encode_prefix, last_logits



class FormatEncoder(Protocol):
    """How a training or scoring run encodes questions in one answer format, and reads option logits back."""

    name: str
    generative: bool  # free-form answers: no options, evaluated by generation

    def fingerprint(self, tokenizer, q: MCQuestion) -> str:
        """Text that fully determines the encoded input (the encoding cache key)."""
        ...

    def encode(self, model, tokenizer, questions: list[MCQuestion], first_trained: int, batch_size: int,
               progress=None) -> list: ...

    def forward(self, model, items: list, first_trained: int, width: int, device): ...

    def option_logits(self, raw, alpha: AlphaParams) -> torch.Tensor:
        """(B, width) calibrated option logits; slots past a question's option count are meaningless (mask them)."""
        ...

    def token_entropy(self, raw, alpha: AlphaParams) -> torch.Tensor:
        """(B,) entropy of the calibrated full-vocabulary distribution at the answer token(s)."""
        ...

    def loss(self, raw, alpha: AlphaParams, labels: torch.Tensor, n_options: torch.Tensor,
             smoothing: float = 0.0) -> torch.Tensor:
        """The lower level g: mean cross-entropy of the gold answer under the calibrated distribution."""
        ...

    def upper_entropy(self, raw, alpha: AlphaParams, n_options: torch.Tensor, over: str) -> torch.Tensor:
        """(B,) the entropy the upper level maximises: over the options, or the vocabulary at the answer token(s)."""
        ...

    def tracked_tokens(self, items: list) -> torch.Tensor:
        """Token ids whose mean scale d is logged during training."""
        ...


class OptionLosses:
    """g and f of multiple-choice formats, from their option logits."""

    def loss(self, raw, alpha, labels, n_options, smoothing=0.0) -> torch.Tensor:
        logits = mask_options(self.option_logits(raw, alpha), n_options.to(labels.device))
        return cross_entropy(logits, labels, smoothing)

    def upper_entropy(self, raw, alpha, n_options, over) -> torch.Tensor:
        if over == "vocab":
            return self.token_entropy(raw, alpha)
        return entropy(mask_options(self.option_logits(raw, alpha), n_options.to(raw.logits.device)))


@dataclass
class LetterLogits:
    logits: torch.Tensor  # (B, V) raw logits at the answer position
    width: int  # option slots to return


class LetterFormat(OptionLosses):
    name = "letter"
    generative = False

    def __init__(self, tokenizer):
        self.letter_ids = torch.tensor(letter_token_ids(tokenizer))

    def fingerprint(self, tokenizer, q: MCQuestion) -> str:
        return letter_prompt(tokenizer, q)

    def encode(self, model, tokenizer, questions, first_trained, batch_size, progress=None) -> list[torch.Tensor]:
        prompts = [letter_prompt(tokenizer, q) for q in questions]
        return encode_prefix(model, tokenizer, prompts, first_trained, batch_size, progress)

    def forward(self, model, items: list[torch.Tensor], first_trained: int, width: int, device) -> LetterLogits:
        return LetterLogits(last_logits(model, collate(items).to(device), first_trained), width)

    def option_logits(self, raw: LetterLogits, alpha: AlphaParams) -> torch.Tensor:
        ids = self.letter_ids[: raw.width].to(raw.logits.device)
        d, l = alpha.rows(ids)
        return apply_alpha(raw.logits[:, ids], d, l)

    def token_entropy(self, raw: LetterLogits, alpha: AlphaParams) -> torch.Tensor:
        d, l = alpha.full()
        return entropy(apply_alpha(raw.logits, d, l))

    def tracked_tokens(self, items) -> torch.Tensor:
        return self.letter_ids


class ClozeFormat(OptionLosses):
    name = "cloze"
    generative = False

    def fingerprint(self, tokenizer, q: MCQuestion) -> str:
        return "\0".join([cloze_prompt(q.question), *(cloze_option(c) for c in q.choices)])

    def encode(self, model, tokenizer, questions, first_trained, batch_size, progress=None) -> list[PackedQuestion]:
        items = [pack_question(cloze_tokens(tokenizer, q.question, q.choices)) for q in questions]
        encode_packed(model, items, first_trained, batch_size, progress)
        return items

    def forward(self, model, items: list[PackedQuestion], first_trained: int, width: int, device):
        return token_logits(model, items, first_trained, width, device)

    def option_logits(self, raw, alpha: AlphaParams) -> torch.Tensor:
        d, l = alpha.full()
        return option_scores(raw, d, l)

    def token_entropy(self, raw, alpha: AlphaParams) -> torch.Tensor:
        d, l = alpha.full()
        return token_entropy(raw, d, l)

    def tracked_tokens(self, items: list[PackedQuestion]) -> torch.Tensor:
        return torch.unique(torch.cat([q.targets for q in items]))


def answer_format(name: AnswerFormat, tokenizer, targets: dict | None = None) -> FormatEncoder:
    """The format by name; the generative one needs each question's answer tokens (training/generative.py)."""
    if name == "generative":
        return GenerativeFormat(tokenizer, targets or {})
    return LetterFormat(tokenizer) if name == "letter" else ClozeFormat()
