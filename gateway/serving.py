"""Serving logic: engine call, calibrated confidence, policy, metrics and the response record.

Routers stay thin; everything a request does between parsing and the HTTP response happens here.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from adapters.engine import EngineClient, EngineOutput, EngineRequest, EngineUnavailable, EngineRejected, generate
from calm_core.prompts import LETTERS, letter_token_ids
from gateway.confidence import option_distribution, sequence_confidence, topk_entropy
from gateway.errors import APIError, sse_error
from gateway.monitoring import DomainMonitor
from gateway.policies import Action, DEFAULT_DOMAIN, Policy, ResolvedPolicy, resolve
from gateway.prompting import PreparedPrompt, prepare_chat, prepare_completion
from gateway.protocol import (
    Calibration, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut, CompletionChoice,
    CompletionRequest, CompletionResponse, OptionProbability, SamplingFields, UsageInfo,
)
from gateway.settings import GatewaySettings
from gateway.store import Store


class PolicyBook:
    """Policies read from the store once and refreshed on every admin write (reads are on the hot path)."""

    def __init__(self, store: Store):
        self.store = store
        self.refresh()

    def refresh(self) -> None:
        self._policies = {d: (Policy.model_validate(body), v) for d, (body, v) in self.store.list_policies().items()}

    def for_domain(self, domain: str) -> tuple[Policy | None, str]:
        for key in (domain, DEFAULT_DOMAIN):
            if key in self._policies:
                policy, version = self._policies[key]
                return policy, f"{key}:v{version}"
        return None, "builtin"


@dataclass
class Answer:
    """Everything a response needs, whatever its wire format."""

    text: str
    finish_reason: str | None
    calibration: Calibration
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float]


class CalibratedService:
    def __init__(self, settings: GatewaySettings, engine: EngineClient, tokenizer, store: Store, monitor: DomainMonitor):
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.store = store
        self.monitor = monitor
        self.policies = PolicyBook(store)
        self.letter_ids = dict(zip(LETTERS, letter_token_ids(tokenizer)))

    # -- request checks -----------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.engine.model_name:
            raise APIError(404, f"model {name!r} does not exist; this gateway serves {self.engine.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def domain_of(self, req: SamplingFields, header: str | None) -> str:
        raw = (req.calm.domain if req.calm and req.calm.domain else None) or (req.metadata or {}).get("domain") or header
        return self.monitor.label(raw)

    def engine_request(self, req: SamplingFields, prompt: PreparedPrompt, max_tokens: int, top_logprobs: int) -> EngineRequest:
        if max_tokens > self.settings.max_tokens_limit:
            raise APIError(400, f"max_tokens {max_tokens} exceeds this gateway's limit of {self.settings.max_tokens_limit}",
                           param="max_tokens", code="max_tokens_exceeded")
        n_prompt = len(self.tokenizer.encode(prompt.text, add_special_tokens=False))
        budget = 1 if prompt.multiple_choice else max_tokens
        if n_prompt + budget > self.engine.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens; the request "
                           f"has {n_prompt} prompt tokens and asks for {budget} more", param="messages",
                           code="context_length_exceeded")
        common = dict(request_id=uuid.uuid4().hex, prompt=prompt.text, temperature=req.temperature or 0.0,
                      top_p=req.top_p or 1.0, seed=req.seed)
        if prompt.multiple_choice:
            ids = tuple(self.letter_ids[letter] for letter in prompt.option_letters)
            return EngineRequest(**common, max_tokens=1, option_token_ids=ids)
        return EngineRequest(**common, max_tokens=max_tokens, stop=req.stop_list(),
                             top_logprobs=max(top_logprobs, self.settings.default_top_logprobs))

    # -- confidence and policy -----------------------------------------------------------------------------------
    def wants_raw(self, req: SamplingFields) -> bool:
        if req.calm is not None and req.calm.raw_confidence is not None:
            return req.calm.raw_confidence
        return self.settings.raw_confidence

    async def run(self, request: EngineRequest, with_raw: bool) -> tuple[EngineOutput, EngineOutput | None]:
        """The calibrated output and, for multiple choice, the same request through the raw model (opted out)."""
        if not (request.option_token_ids and with_raw):
            return await generate(self.engine, request), None
        raw_request = replace(request, request_id=request.request_id + "-raw", calibrated=False)
        return tuple(await asyncio.gather(generate(self.engine, request), generate(self.engine, raw_request)))

    def policy_for(self, domain: str, requested_threshold: float | None = None) -> ResolvedPolicy:
        policy, name = self.policies.for_domain(domain)
        return resolve(policy, name, self.monitor.reference(domain), requested_threshold)

    def answer(self, prompt: PreparedPrompt, out: EngineOutput, raw: EngineOutput | None, domain: str,
               policy: ResolvedPolicy) -> Answer:
        options = None
        if prompt.multiple_choice:
            ids = [self.letter_ids[letter] for letter in prompt.option_letters]
            chosen = out.token_ids[0] if out.token_ids else None
            dist = option_distribution(out.top_logprobs[0] if out.top_logprobs else {}, ids, chosen)
            letter = prompt.option_letters[dist.chosen]
            confidence, entropy, text = dist.confidence, dist.entropy, letter
            raw_conf = None
            if raw is not None and raw.top_logprobs:
                raw_conf = float(option_distribution(raw.top_logprobs[0], ids).probs[dist.chosen])
            options = [OptionProbability(label=l, probability=float(p)) for l, p in zip(prompt.option_letters, dist.probs)]
        else:
            confidence = sequence_confidence(out.token_logprobs)
            entropy = topk_entropy(out.top_logprobs)
            text, raw_conf = out.text, None
        below = confidence < policy.threshold
        abstained = below and policy.action is Action.ABSTAIN
        calibration = Calibration(
            confidence=confidence, raw_confidence=raw_conf, abstained=abstained, threshold=policy.threshold,
            policy=policy.name, domain=domain, artifact_version=self.engine.artifact_version,
            mode="multiple_choice" if prompt.multiple_choice else "free_form", entropy=entropy, options=options,
        )
        self.monitor.observe_answer(domain, confidence, entropy, below, abstained)
        return Answer(policy.message if abstained else text, out.finish_reason, calibration, out.prompt_tokens,
                      len(out.token_ids), out.token_logprobs)

    # -- endpoints -----------------------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, domain: str):
        self.check_model(req.model)
        prompt = prepare_chat(self.tokenizer, req)
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        served = await self._serve(req, domain, prompt, max_tokens, req.top_logprobs or 0, "chatcmpl", "chat.completion.chunk")
        if not isinstance(served, tuple):
            return served
        response_id, answer = served
        return ChatCompletionResponse(
            id=response_id, model=req.model,
            choices=[ChatChoice(message=ChatMessageOut(content=answer.text), finish_reason=answer.finish_reason,
                                logprobs=_logprobs(answer) if req.logprobs else None, calibration=answer.calibration)],
            usage=_usage(answer),
        )

    async def completion(self, req: CompletionRequest, domain: str):
        self.check_model(req.model)
        prompt = prepare_completion(req)
        served = await self._serve(req, domain, prompt, req.max_tokens, req.logprobs or 0, "cmpl", "text_completion")
        if not isinstance(served, tuple):
            return served
        response_id, answer = served
        return CompletionResponse(
            id=response_id, model=req.model,
            choices=[CompletionChoice(text=answer.text, finish_reason=answer.finish_reason,
                                      logprobs=_logprobs(answer) if req.logprobs is not None else None,
                                      calibration=answer.calibration)],
            usage=_usage(answer),
        )

    async def _serve(self, req: SamplingFields, domain: str, prompt: PreparedPrompt, max_tokens: int, top: int,
                     id_prefix: str, chunk_kind: str):
        """(response id, Answer), or the SSE stream when the request streams."""
        request = self.engine_request(req, prompt, max_tokens, top)
        policy = self.policy_for(domain, req.calm.threshold if req.calm else None)
        response_id = f"{id_prefix}-{request.request_id}"
        if req.stream:
            return self._stream(response_id, chunk_kind, req.model, prompt, request, domain, policy, self.wants_raw(req))
        return response_id, await self._complete(prompt, request, domain, policy, response_id, self.wants_raw(req))

    async def _complete(self, prompt, request, domain, policy, response_id, with_raw) -> Answer:
        out, raw = await self.run(request, with_raw)
        answer = self.answer(prompt, out, raw, domain, policy)
        self.store.record_response(response_id, domain, answer.calibration.confidence)
        return answer

    async def _stream(self, response_id, kind, model, prompt, request, domain, policy, with_raw) -> AsyncIterator[str]:
        """SSE chunks in OpenAI's shape; the calibration object arrives with the final chunk.

        Multiple choice and abstain policies need the whole answer before any text may be shown, so those are
        buffered; free-form answers under an annotate policy stream token by token.
        """
        chat = kind == "chat.completion.chunk"
        created = int(time.time())

        def chunk(text: str | None, finish: str | None = None, calibration: Calibration | None = None, first=False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            if calibration is not None:
                choice["calibration"] = calibration.model_dump()
            body = {"id": response_id, "object": kind, "created": created, "model": model, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk(None, first=True)
            if prompt.multiple_choice or policy.action is Action.ABSTAIN:
                answer = await self._complete(prompt, request, domain, policy, response_id, with_raw)
                yield chunk(answer.text)
                yield chunk(None, answer.finish_reason, answer.calibration)
            else:
                deltas = []
                async for delta in self.engine.stream(request):
                    deltas.append(delta)
                    if delta.text:
                        yield chunk(delta.text)
                answer = self.answer(prompt, EngineOutput.collect(deltas), None, domain, policy)
                self.store.record_response(response_id, domain, answer.calibration.confidence)
                yield chunk(None, answer.finish_reason, answer.calibration)
            yield "data: [DONE]\n\n"
        except EngineUnavailable as e:
            yield sse_error(503, f"model engine unavailable: {e}", "service_unavailable_error")
        except EngineRejected as e:
            yield sse_error(400, str(e), "invalid_request_error")
        except asyncio.CancelledError:
            await self.engine.abort(request.request_id)
            raise


def _usage(answer: Answer) -> UsageInfo:
    return UsageInfo(prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens,
                     total_tokens=answer.prompt_tokens + answer.completion_tokens)


def _logprobs(answer: Answer) -> dict:
    return {"token_logprobs": [lp if math.isfinite(lp) else None for lp in answer.logprobs]}
