"""Log-probs in OpenAI's wire shapes, built the way vLLM's OpenAI server builds them (pure functions).

A position is the chosen token and an ordered list of (token, log-prob) alternatives. vLLM orders the alternatives
with the sampled token first, then the top-k by rank (a dict, so the sampled token appears once), and returns the
first `top_logprobs` of them on chat and the first `logprobs + 1` on completions; log-probs are clipped at -9999 so
that -inf stays valid JSON. Multiple-choice answers have one position: the chosen option letter, alternatives the
option letters (chosen first, then by probability), log-probs from the options' calibrated distribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.protocol.openai import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True)
class Position:
    token: str
    logprob: float
    alternatives: tuple[tuple[str, float], ...]  # sampled first, then by rank


def _clip(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR) if not math.isnan(logprob) else LOGPROB_FLOOR


def token_positions(token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[dict[int, float]],
                    token_text: Callable[[int], str]) -> list[Position]:
    """Positions of generated tokens from the engine's per-token log-probs and ordered top-k dicts."""
    return [Position(token_text(t), lp, tuple((token_text(k), v) for k, v in alternatives.items()))
            for t, lp, alternatives in zip(token_ids, logprobs, top)]


def option_position(letters: Sequence[str], probs: Sequence[float], chosen: int) -> Position:
    order = [chosen] + sorted((i for i in range(len(letters)) if i != chosen), key=lambda i: -probs[i])
    log = [math.log(p) if p > 0 else -math.inf for p in probs]
    return Position(letters[chosen], log[chosen], tuple((letters[i], log[i]) for i in order))


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(positions: Sequence[Position], top_logprobs: int) -> ChatLogprobs:
    return ChatLogprobs(content=[
        TokenLogprob(token=p.token, logprob=_clip(p.logprob), bytes=_utf8(p.token),
                     top_logprobs=[TopLogprob(token=t, logprob=_clip(lp), bytes=_utf8(t))
                                   for t, lp in p.alternatives[:top_logprobs]])
        for p in positions
    ])


def _completion_alternatives(p: Position, k: int) -> tuple[tuple[str, float], ...]:
    """The sampled token and the top k (vLLM's completions rule): k + 1 entries, or k when the sampled token is
    itself among the top k. The gateway asks the engine for more than k, so the rank is read from the values."""
    rank = 1 + sum(1 for _, lp in p.alternatives[1:] if lp > p.logprob)
    return p.alternatives[: k if 0 < rank <= k else k + 1]


def completion_logprobs(positions: Sequence[Position], logprobs: int, text_offset: int = 0) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = text_offset
    for p in positions:
        out.tokens.append(p.token)
        out.token_logprobs.append(_clip(p.logprob))
        out.top_logprobs.append({t: _clip(lp) for t, lp in _completion_alternatives(p, logprobs)})
        out.text_offset.append(offset)
        offset += len(p.token)
    return out
