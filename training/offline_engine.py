"""An offline engine over a transformers model: what `calm eval --artifact`, the reports and the retraining gate score
multiple-choice questions through, with the gateway's own scorers (calm_core/scorers/).

It answers the requests the multiple-choice scorers make: one next-token position (the letter format, cloze per
token), in padded batches, with the α head applied when the request is calibrated; and prompt log-probs (cloze in one
pass), with the head applied at every position when the request asks for the `folded` weights — the same numbers
vLLM returns for weights with the head folded into the LM head. Prompt log-prob requests that share a prefix (the
options of one question) run as one packed sequence: the prefix once, each continuation seeing the prefix and itself
(training/cloze.py's packing), as a prefix cache would — the question is read once, not once per option. The model is the served one (the artifact's adapter merged
by the caller), so `adapter` is implied. Free-form generation is the vLLM engines' job: refused here.

Engines over one model may share a `ForwardMemo`: what the model computed for a token sequence (the heads are applied
afterwards), so versions that differ by their heads alone (a head-only candidate and its parent, judged side by side)
run each question through the model once. Engines over models that share their frozen bottom (training/frozen_states.py)
may share its states: a packed question whose states are there runs through the top layers only (prompt log-prob
requests; the letter format's plain requests run the whole model).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from functools import partial

import numpy as np
import torch

from calm_core.alpha_head import AlphaHead
from calm_core.engine import EngineDelta, EngineRejected, EngineRequest
from calm_core.prompts import ClozeTokens
from training.cloze import PAD_SEGMENT, PackedQuestion, encode_packed, pack_question, packed_mask, pad_packed
from training.frozen_states import FrozenStates
from training.top_layers import decoder, run_layers_masked

Pending = tuple[EngineRequest, tuple[int, ...], asyncio.Future]
# What the model computed for a request (keyed by its token ids) or a packed group of them (by all their ids and the
# first position read): the logits of a packed row from that position, the last position's logits of a plain request.
# Valid for one model only; ~0.2 MB per position of a 49,152-token vocabulary, so sharers bound what they keep.
ForwardMemo = dict[tuple, torch.Tensor]


def shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def first_read_row(request: EngineRequest, length: int) -> int:
    """The first position whose logits a prompt log-prob request reads: the one predicting its first read prompt token
    (the last position, the next token, is always read)."""
    return min(max(request.prompt_logprobs_from - 1, 0), length - 1)


def prefix_groups(pending: list[Pending]) -> list[list[Pending]]:
    """Requests whose token ids share at least half of the shorter one's length, grouped (sorted by ids, so the
    options of a question sit together)."""
    groups: list[list[Pending]] = []
    for item in sorted(pending, key=lambda p: p[1]):
        if groups and 2 * shared_prefix(groups[-1][0][1], item[1]) >= min(len(groups[-1][0][1]), len(item[1])):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


class OfflineEngine:
    model_name = "offline"
    folded_scoring = True  # the head is applied to prompt log-probs on request: one-pass cloze scoring
    free_form_mode = False
    prompt_logprobs = True

    def __init__(self, model, tokenizer, head: AlphaHead | None, batch_size: int = 8, artifact_version: str = "offline",
                 memo: ForwardMemo | None = None, frozen: FrozenStates | None = None):
        """`frozen`: states of this model's own bottom (the caller checks with FrozenStates.serve)."""
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.memo = memo  # None: nothing is kept past the batch that computed it
        self.frozen = frozen
        self.artifact_version = artifact_version
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
        vocab = model.get_output_embeddings().weight.shape[0]
        head = head if head is not None else AlphaHead.identity(vocab)
        head.check_vocab(vocab)
        # Wherever the model is (a GPU in scripts/gpu_check.sh part a); the scores come back to the host.
        self.device = next(model.parameters()).device
        self.scale = torch.as_tensor(np.asarray(head.scale), dtype=torch.float32, device=self.device)
        self.shift = torch.as_tensor(np.asarray(head.shift), dtype=torch.float32, device=self.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._pending: list[Pending] = []
        self._flushing = False

    # -- EngineClient ---------------------------------------------------------------------------------------------------
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None: ...

    def describe(self) -> dict:
        return {"kind": "offline (transformers)", "batch_size": self.batch_size}

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if request.max_tokens != 1 or request.n != 1 or request.free_form or request.temperature > 0:
            raise EngineRejected("the offline engine scores one greedy next-token position per request")
        ids = request.prompt_token_ids or tuple(self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"])
        future = asyncio.get_running_loop().create_future()
        self._pending.append((request, tuple(int(t) for t in ids), future))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush()))
        yield await future

    # -- batching -------------------------------------------------------------------------------------------------------
    async def _flush(self) -> None:
        """Answer everything queued: prompt log-probs packed per shared prefix, the rest in batches of similar length;
        requests queued meanwhile join the next round."""
        try:
            while self._pending:
                pending, self._pending = self._pending, []
                groups = prefix_groups([p for p in pending if p[0].prompt_logprobs])
                plain = sorted((p for p in pending if not p[0].prompt_logprobs), key=lambda p: len(p[1]))
                work = [(partial(self._answer_packed, [[(r, ids) for r, ids, _ in g] for g in chunk]),
                         [p for g in chunk for p in g])
                        for chunk in (groups[i : i + self.batch_size] for i in range(0, len(groups), self.batch_size))]
                work += [(partial(self._answer, [(r, ids) for r, ids, _ in batch]), batch)
                         for batch in (plain[i : i + self.batch_size] for i in range(0, len(plain), self.batch_size))]
                for answer, batch in work:
                    try:
                        deltas = await asyncio.to_thread(answer)
                    except Exception as e:  # every waiting request learns why
                        for _, _, future in batch:
                            future.set_exception(e)
                        continue
                    for (_, _, future), delta in zip(batch, deltas):
                        future.set_result(delta)
        finally:
            self._flushing = False

    @torch.inference_mode()
    def _answer_packed(self, groups: list[list[tuple[EngineRequest, tuple[int, ...]]]]) -> list[EngineDelta]:
        """Groups of requests sharing a prefix, each packed into one row: the prefix once, then every request's own
        continuation seeing the prefix and itself. A request's logits are the prefix rows and its own rows, exactly
        what a forward over its ids alone computes. The deltas come in the groups' order."""
        layouts = []
        for group in groups:
            ids = [i for _, i in group]
            prefix = min(min(shared_prefix(ids[0], other) for other in ids), min(map(len, ids)) - 1)
            layouts.append((prefix, pack_question(ClozeTokens(ids[0][:prefix], tuple(i[prefix:] for i in ids)))))
        firsts = [[first_read_row(request, len(own)) for request, own in group] for group in groups]
        # The LM head runs over a packed row from the first position any request reads: the prefix's read rows, then
        # every continuation. What it gives is kept by that row (and that first position), so versions sharing the memo
        # (a head-only candidate and its parent) run the LM head once too, not only the layers below it.
        keys = [(tuple(i for _, i in group), min(min(read), prefix)) for group, read, (prefix, _) in
                zip(groups, firsts, layouts)]
        memo = {} if self.memo is None else self.memo
        stack, lm_head = decoder(self.model)
        todo = [n for n, key in enumerate(keys) if key not in memo]
        states = {}  # the read rows' final states; their logits are made one group at a time, kept only when shared
        if todo:
            packed = [layouts[n][1] for n in todo]
            segment = pad_packed(packed, [q.segment for q in packed], PAD_SEGMENT).to(self.device)
            positions = pad_packed(packed, [q.positions for q in packed], 0).to(self.device)
            if self.frozen is None:
                hidden = run_layers_masked(stack, stack.layers, self._embedded(packed), packed_mask(segment), positions)
            else:
                hidden = run_layers_masked(stack, stack.layers[self.frozen.layer :], self._frozen_states(packed),
                                           packed_mask(segment), positions)
            for row, n in enumerate(todo):
                states[keys[n]] = stack.norm(hidden[row, keys[n][1] : len(packed[row].input_ids)])
        deltas = []
        for group, read, key, (prefix, _) in zip(groups, firsts, keys, layouts):
            top = key[1]
            logits = memo[key] if key in memo else lm_head(states[key]).float()
            if self.memo is not None:
                memo[key] = logits
            start = prefix
            for (request, own), first in zip(group, read):
                rows = list(range(prefix)) + list(range(start, start + len(own) - prefix))
                start += len(own) - prefix
                deltas.append(self._delta(request, own, logits[[row - top for row in rows[first:]]], first))
        return deltas

    def _embedded(self, packed: list[PackedQuestion]) -> torch.Tensor:
        stack, _ = decoder(self.model)
        return stack.embed_tokens(pad_packed(packed, [q.input_ids for q in packed], 0).to(self.device))

    def _frozen_states(self, packed: list[PackedQuestion]) -> torch.Tensor:
        """The states entering the first layer above the frozen bottom, padded as the packed rows: those the frozen
        states hold, the others computed now through the bottom and kept there for the next model that shares it."""
        frozen = self.frozen
        missing = [q for q in packed if q not in frozen]
        if missing:  # encoded as training encodes them, in one batch
            encode_packed(self.model, missing, frozen.layer, batch_size=len(missing))
            for q in missing:
                frozen.add(q, q.hidden)
        return pad_packed(packed, [frozen.rows(q).to(self.device) for q in packed], 0.0)

    @torch.inference_mode()
    def _answer(self, batch: list[tuple[EngineRequest, tuple[int, ...]]]) -> list[EngineDelta]:
        """Requests without prompt log-probs: only the last position's logits are read."""
        memo = {} if self.memo is None else self.memo
        todo = [(request, ids) for request, ids in batch if ids not in memo]
        if todo:
            longest = max(len(ids) for _, ids in todo)
            input_ids = torch.full((len(todo), longest), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(todo), longest), dtype=torch.long)
            for row, (_, ids) in enumerate(todo):  # right padding: a real position never sees a pad token
                input_ids[row, : len(ids)] = torch.tensor(ids)
                mask[row, : len(ids)] = 1
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits.float()
            for row, (_, ids) in enumerate(todo):
                memo[ids] = logits[row, len(ids) - 1 : len(ids)].clone()  # a view would keep the batch's logits
        return [self._delta(request, ids, memo[ids]) for request, ids in batch]

    def _delta(self, request: EngineRequest, ids: tuple[int, ...], logits: torch.Tensor, first: int = 0) -> EngineDelta:
        """`logits`: the rows of positions `first` to the last; prompt log-probs before `first` + 1 stay NaN."""
        last = logits[-1].double()
        if request.calibrated:
            last = self.scale.double() * last + self.shift.double()
        logp = torch.log_softmax(last, -1)
        allowed = list(request.option_token_ids) if request.option_token_ids and request.restrict_to_options else None
        token = int(max(allowed, key=lambda t: logp[t]) if allowed else torch.argmax(logp))
        top = {int(t): float(logp[t]) for t in request.option_token_ids}
        top[token] = float(logp[token])
        prompt_lps = None
        if request.prompt_logprobs:
            body = self.scale * logits[:-1] + self.shift if request.folded else logits[:-1]
            targets = torch.tensor(ids[first + 1 :], device=self.device)[:, None]
            picked = torch.log_softmax(body, -1).gather(1, targets).squeeze(1)
            prompt_lps = [math.nan] * (first + 1) + [float(v) for v in picked]
        return EngineDelta(text=self.tokenizer.decode([token]), token_ids=[token], token_logprobs=[top[token]],
                           top_logprobs=[top], finish_reason="length", prompt_tokens=len(ids), prompt_logprobs=prompt_lps)
