"""vLLM's request outputs as the engine seam's deltas (calm_core/engine.py), whichever model runner produced them."""

from __future__ import annotations

from calm_core.engine import EngineDelta


def prompt_logprobs_by_position(ids: list[int], rows: list, cached: int) -> list[float]:
    """The log-prob of each prompt token (NaN where unknown) from vLLM's prompt log-prob rows, on either runner.

    Both runners put None for the first token. Read after the prefix cache (`reuse_prefix`), the first `cached`
    positions were not computed: V1 still returns their rows (stale), V2 leaves them out, so its rows start at the
    first computed position. The rows end at the last prompt token either way, so they are aligned from the end; the
    first token after the cached ones is unknown too (its logits are the last cached position's)."""
    offset = len(ids) - len(rows)
    known_from = max(cached + 1 if cached else 0, offset)
    values = [float("nan")] * len(ids)
    for i in range(known_from, len(ids)):
        row = rows[i - offset]
        if row and ids[i] in row:
            values[i] = float(row[ids[i]].logprob)
    return values


def deltas_from_output(out, started: bool) -> list[EngineDelta]:
    """One delta per completion with new output (n > 1 requests interleave their completions)."""
    deltas = []
    for completion in out.outputs:
        delta = EngineDelta(
            text=completion.text,
            token_ids=list(completion.token_ids),
            finish_reason=completion.finish_reason,
            prompt_tokens=None if started else len(out.prompt_token_ids or []),
            index=completion.index,
            prompt_token_ids=None if started or out.prompt_token_ids is None else list(out.prompt_token_ids),
        )
        if not started and out.prompt_logprobs:
            delta.prompt_logprobs = prompt_logprobs_by_position(out.prompt_token_ids or [], out.prompt_logprobs,
                                                                getattr(out, "num_cached_tokens", 0) or 0)
        for tok, position in zip(completion.token_ids, completion.logprobs or []):
            delta.token_logprobs.append(float(position[tok].logprob) if tok in position else float("nan"))
            delta.top_logprobs.append({int(t): float(lp.logprob) for t, lp in position.items()})
        deltas.append(delta)
    return deltas
