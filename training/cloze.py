"""Cloze option scoring: each option's length-normalised log-likelihood as the text after the question, with the α
head acting on every token logit of the option text.

    score_k = mean over the option's tokens y_t of  log softmax(d ⊙ z_t + l)[y_t]
    p(option k) = softmax_k(score_k)

Packing: a question and all its options form one sequence [prompt | option 1 | option 2 | ...]. Each option attends
to the prompt and to itself only, and its positions continue from the prompt's end, so every option sees exactly what
it would see alone after the prompt (a test checks this against separate full-model runs) while the prompt is
processed once instead of once per option.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calm_core.alpha_head import apply_alpha
from calm_core.prompts import ClozeTokens
from training.top_layers import decoder, run_layers_masked

PAD_SEGMENT = -1


@dataclass
class PackedQuestion:
    """Token layout of one packed question; `hidden` is filled by encoding (states entering the first trained layer)."""

    input_ids: torch.Tensor  # (T,)
    segment: torch.Tensor  # (T,) 0 = prompt, k + 1 = option k
    positions: torch.Tensor  # (T,) option positions restart at the prompt's end
    pred_pos: torch.Tensor  # (P,) the positions whose logits predict the option tokens
    targets: torch.Tensor  # (P,) the option tokens
    option_of: torch.Tensor  # (P,) which option each target belongs to
    hidden: torch.Tensor | None = None  # (T, H)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def pack_question(tokens: ClozeTokens) -> PackedQuestion:
    prompt = list(tokens.prompt)
    n_prompt = len(prompt)
    ids, segment, positions = list(prompt), [0] * n_prompt, list(range(n_prompt))
    pred_pos, targets, option_of = [], [], []
    for k, option in enumerate(tokens.options):
        start = len(ids)
        for j, token in enumerate(option):
            # The first option token is predicted from the prompt's last position, the rest from the option itself.
            pred_pos.append(n_prompt - 1 if j == 0 else start + j - 1)
            targets.append(token)
            option_of.append(k)
        ids += option
        segment += [k + 1] * len(option)
        positions += range(n_prompt, n_prompt + len(option))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return PackedQuestion(as_long(ids), as_long(segment), as_long(positions), as_long(pred_pos), as_long(targets),
                          as_long(option_of))


def packed_mask(segment: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) boolean mask, True = attend: causal, and a key is visible if it is in the prompt or in the query's
    own option. No real token sees padding; padding rows (outputs unused) also see themselves so that no row is
    fully masked (sdpa would return NaN there)."""
    length = segment.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment.device).tril()
    key, query = segment[:, None, :], segment[:, :, None]
    allowed = causal & (key >= 0) & ((key == 0) | (key == query))
    allowed |= torch.eye(length, dtype=torch.bool, device=segment.device)
    return allowed[:, None]


def pad_packed(items: list[PackedQuestion], rows: list[torch.Tensor], fill) -> torch.Tensor:
    length = max(len(q) for q in items)
    first = rows[0]
    out = first.new_full((len(items), length, *first.shape[1:]), fill)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


@torch.inference_mode()
def encode_packed(model, items: list[PackedQuestion], first_trained: int, batch_size: int = 16, progress=None) -> None:
    """Fill each item's `hidden` with the states entering layer `first_trained` (the frozen bottom, run once)."""
    stack, _ = decoder(model)
    device = stack.embed_tokens.weight.device
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    for start in range(0, len(order), batch_size):
        batch = [items[i] for i in order[start : start + batch_size]]
        ids = pad_packed(batch, [q.input_ids for q in batch], 0).to(device)
        segment = pad_packed(batch, [q.segment for q in batch], PAD_SEGMENT).to(device)
        positions = pad_packed(batch, [q.positions for q in batch], 0).to(device)
        hidden = run_layers_masked(stack, stack.layers[:first_trained], stack.embed_tokens(ids), packed_mask(segment),
                                   positions)
        for row, q in enumerate(batch):
            q.hidden = hidden[row, : len(q)].clone()
        if progress is not None:
            progress(len(batch))


@dataclass
class TokenLogits:
    """Raw (uncalibrated) logits at every option-token position of a batch, with where each belongs."""

    logits: torch.Tensor  # (P, V)
    targets: torch.Tensor  # (P,)
    slot: torch.Tensor  # (P,) row * width + option
    rows: int
    width: int


def token_logits(model, items: list[PackedQuestion], first_trained: int, width: int, device) -> TokenLogits:
    """Run the trained top layers over packed questions; logits only where option tokens are predicted."""
    stack, lm_head = decoder(model)
    hidden = pad_packed(items, [q.hidden for q in items], 0.0).to(device)
    segment = pad_packed(items, [q.segment for q in items], PAD_SEGMENT).to(device)
    positions = pad_packed(items, [q.positions for q in items], 0).to(device)
    hidden = run_layers_masked(stack, stack.layers[first_trained:], hidden, packed_mask(segment), positions)
    rows = torch.cat([torch.full_like(q.pred_pos, i) for i, q in enumerate(items)]).to(device)
    cols = torch.cat([q.pred_pos for q in items]).to(device)
    logits = lm_head(stack.norm(hidden[rows, cols]))
    slot = torch.cat([i * width + q.option_of for i, q in enumerate(items)]).to(device)
    return TokenLogits(logits, torch.cat([q.targets for q in items]).to(device), slot, len(items), width)


def mean_by(values: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Mean of `values` per group index; groups without values are 0."""
    sums = values.new_zeros(n_groups).index_add(0, group, values)
    counts = values.new_zeros(n_groups).index_add(0, group, torch.ones_like(values))
    return sums / counts.clamp(min=1)


def option_scores(raw: TokenLogits, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(B, width) mean calibrated log-likelihood of each option's tokens; slots without an option are 0 (mask them).
    The rule of calm_core.scoring.cloze_scores over a packed batch, differentiable in θ and α."""
    logp = torch.log_softmax(apply_alpha(raw.logits, scale, shift), -1).gather(1, raw.targets[:, None]).squeeze(1)
    return mean_by(logp, raw.slot, raw.rows * raw.width).view(raw.rows, raw.width)


def token_entropy(raw: TokenLogits, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """(B,) mean Shannon entropy (nats) of the calibrated full-vocabulary distribution at each question's option tokens."""
    logp = torch.log_softmax(apply_alpha(raw.logits, scale, shift), -1)
    per_position = -(logp.exp() * logp).sum(-1)
    return mean_by(per_position, torch.div(raw.slot, raw.width, rounding_mode="floor"), raw.rows)
