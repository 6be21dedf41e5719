"""Free-form answers as a training answer format: the question under the chat template (the prompt the gateway
serves), the answer as the tokens that follow it, ending with the end-of-turn token.

    lower level g   mean over answer tokens of −log softmax(d ⊙ z_t + l)[y_t], y = the gold short answer
    upper level f   −(mean over answer positions of the entropy of softmax(d ⊙ z_t + l)), at the positions of the
                    model's own greedy answer to each unlabelled calibration prompt: generated once by the initial
                    model (θ0, no head), at most GREEDY_TOKENS tokens, and cached on disk; or, where an engine already
                    served the starting weights' answers (a retraining job's active mode), those answers

Packing reuses training/cloze.py: a question with one "option", its answer. Labels and option counts are all 0 and 1,
so the trainer's batching and caching do not change.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from calm_core.alpha_head import apply_alpha
from calm_core.data import OpenQuestion
from calm_core.prompts import ClozeTokens, render_chat
from training.alpha_params import AlphaParams
from training.cloze import (
    PackedQuestion, mean_by, encode_packed, option_scores, pack_question, token_entropy, token_logits,
)

GREEDY_TOKENS = 32  # calibration answers are cut here: the entropy is taken where the answer is given, not rambling


def free_form_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question.strip()}]


def free_form_prompt(tokenizer, question: str) -> str:
    """What a chat request with the question as its one user message becomes in the gateway."""
    return render_chat(tokenizer, free_form_messages(question))


def encode_text(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])


def gold_target(tokenizer, q: OpenQuestion) -> tuple[int, ...]:
    """The gold short answer as the model should emit it, then the end-of-turn token."""
    return encode_text(tokenizer, q.answer.strip()) + (int(tokenizer.eos_token_id),)


def greedy_answer(ids: list[int], eos: int, max_new_tokens: int = GREEDY_TOKENS) -> tuple[int, ...]:
    """A greedy answer's tokens as a calibration target: at most `max_new_tokens`, ending at the end-of-turn token
    when the answer stopped there (an empty answer is that token alone)."""
    ids = [int(t) for t in ids[:max_new_tokens]]
    if eos in ids:
        ids = ids[: ids.index(eos) + 1]
    return tuple(ids) or (eos,)


def served_answers(path: str | None, tokenizer, questions: list[OpenQuestion],
                   max_new_tokens: int = GREEDY_TOKENS) -> dict[str, tuple[int, ...]]:
    """The calibration targets of the questions whose greedy answers an engine served (TrainConfig's
    `calibration_answers`), cut as a generated one is: the same answer, without asking the model for it again."""
    if path is None:
        return {}
    given = json.loads(Path(path).read_text())
    eos = int(tokenizer.eos_token_id)
    return {q.id: greedy_answer(given[q.id], eos, max_new_tokens) for q in questions if given.get(q.id) is not None}


@torch.inference_mode()
def greedy_targets(model, tokenizer, questions: list[OpenQuestion], cache_dir: Path, weights_id: str,
                   batch_size: int = 32, max_new_tokens: int = GREEDY_TOKENS) -> dict[str, tuple[int, ...]]:
    """The model's own greedy answer tokens to each prompt (with its end-of-turn token when it stopped), cached per
    weights and prompts. The model is the initial one: LoRA's B matrices start at zero, so this is θ0."""
    if not questions:
        return {}
    prompts = [free_form_prompt(tokenizer, q.question) for q in questions]
    key = hashlib.sha256(json.dumps([weights_id, max_new_tokens, prompts]).encode()).hexdigest()[:24]
    path = cache_dir / f"greedy-{key}.json"
    if path.is_file():
        return {k: tuple(v) for k, v in json.loads(path.read_text()).items()}
    from rich.progress import Progress

    tokenizer.padding_side = "left"
    out: dict[str, tuple[int, ...]] = {}
    eos, pad = int(tokenizer.eos_token_id), tokenizer.pad_token_id
    order = sorted(range(len(questions)), key=lambda i: len(prompts[i]))
    with Progress() as bar:
        task = bar.add_task("greedy answers of calibration prompts", total=len(questions))
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
            for row, i in enumerate(idx):
                out[questions[i].id] = greedy_answer(gen[row, enc["input_ids"].shape[1] :].tolist(), eos, max_new_tokens)
            bar.advance(task, len(idx))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(path)
    return out


def answer_nll(raw, alpha: AlphaParams, smoothing: float = 0.0) -> torch.Tensor:
    """(B,) mean calibrated NLL of each answer's tokens; with smoothing, each token's target spreads `smoothing` evenly
    over the vocabulary."""
    d, l = alpha.full()
    nll = -option_scores(raw, d, l)[:, 0]
    if smoothing == 0.0:
        return nll
    uniform = -torch.log_softmax(apply_alpha(raw.logits, d, l), -1).mean(-1)
    return (1 - smoothing) * nll + smoothing * mean_by(uniform, torch.div(raw.slot, raw.width, rounding_mode="floor"), raw.rows)


class GenerativeFormat:
    name = "generative"
    generative = True

    def __init__(self, tokenizer, targets: dict[str, tuple[int, ...]]):
        self.tokenizer = tokenizer
        self.targets = targets  # question id -> answer tokens: gold for labelled roles, greedy for calibration

    def fingerprint(self, tokenizer, q: OpenQuestion) -> str:
        return free_form_prompt(tokenizer, q.question) + "\0" + ",".join(map(str, self.targets[q.id]))

    def encode(self, model, tokenizer, questions, first_trained, batch_size, progress=None) -> list[PackedQuestion]:
        items = [pack_question(ClozeTokens(encode_text(tokenizer, free_form_prompt(tokenizer, q.question)),
                                           (self.targets[q.id],))) for q in questions]
        encode_packed(model, items, first_trained, batch_size, progress)
        return items

    def forward(self, model, items: list[PackedQuestion], first_trained: int, width: int, device):
        return token_logits(model, items, first_trained, 1, device)

    def loss(self, raw, alpha: AlphaParams, labels: torch.Tensor, n_options: torch.Tensor,
             smoothing: float = 0.0) -> torch.Tensor:
        return answer_nll(raw, alpha, smoothing).mean()

    def upper_entropy(self, raw, alpha: AlphaParams, n_options: torch.Tensor, over: str) -> torch.Tensor:
        d, l = alpha.full()
        return token_entropy(raw, d, l)

    def tracked_tokens(self, items: list[PackedQuestion]) -> torch.Tensor:
        return torch.unique(torch.cat([q.targets for q in items]))


@torch.no_grad()
def position_logits(model, items: list[PackedQuestion], first_trained: int, device, batch_size: int = 32):
    """Raw logits at every answer position of a set, batch by batch: (P, V) and the question index of each row."""
    chunks, owners = [], []
    for start in range(0, len(items), batch_size):
        raw = token_logits(model, items[start : start + batch_size], first_trained, 1, device)
        chunks.append(raw.logits.float().cpu())
        owners.append(raw.slot.cpu() + start)
    return torch.cat(chunks), torch.cat(owners)

