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

import numpy as np

from adapters.engine import EngineClient, EngineOutput, EngineRequest, EngineUnavailable, EngineRejected, generate
from calm_core.prompts import LETTERS, AnswerFormatName, ClozeTokens, letter_token_ids
from gateway.confidence import OptionDistribution, cloze_scores, option_distribution, options_softmax, sequence_confidence, topk_entropy
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


@dataclass(frozen=True)
class ServedArtifact:
    """What the gateway needs to know about the served artifact to route a request through it."""

    answer_format: AnswerFormatName = "letter"  # how its head was fitted to multiple choice
    multiple_choice_only: bool = False  # free-form answers then use the base weights without the head
    has_adapter: bool = False

    @classmethod
    def of(cls, manifest) -> "ServedArtifact":
        return cls(manifest.answer_format, manifest.applies_to == "multiple_choice", manifest.has_adapter)


@dataclass
class OptionChoice:
    """A multiple-choice decision: the calibrated options' distribution, the raw one if asked, and the token counts."""

    dist: OptionDistribution
    raw_probs: np.ndarray | None
    prompt_tokens: int
    completion_tokens: int


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
    def __init__(self, settings: GatewaySettings, engine: EngineClient, tokenizer, store: Store, monitor: DomainMonitor,
                 artifact: ServedArtifact = ServedArtifact()):
        self.settings = settings
        self.artifact = artifact
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
        if prompt.cloze:
            # The longest scoring request: the prompt and all but the last token of the longest option, plus one.
            n_prompt, budget = len(prompt.cloze.prompt) + max(map(len, prompt.cloze.options)) - 1, 1
        else:
            n_prompt = len(self.tokenizer.encode(prompt.text, add_special_tokens=False))
            budget = 1 if prompt.multiple_choice else max_tokens
        if n_prompt + budget > self.engine.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens; the request "
                           f"has {n_prompt} prompt tokens and asks for {budget} more", param="messages",
                           code="context_length_exceeded")
        # The artifact's weights and head serve the answers they were fitted for.
        fitted = prompt.multiple_choice or not self.artifact.multiple_choice_only
        common = dict(request_id=uuid.uuid4().hex, prompt=prompt.text, temperature=req.temperature or 0.0,
                      top_p=req.top_p or 1.0, seed=req.seed, calibrated=fitted, adapter=fitted and self.artifact.has_adapter)
        if prompt.cloze:
            return EngineRequest(**common, max_tokens=1)  # a template: choose_option sends one request per option token
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

    async def choose_option(self, prompt: PreparedPrompt, request: EngineRequest, with_raw: bool) -> OptionChoice:
        """The calibrated options' distribution and, if asked, the raw model's (the same requests, α head skipped)."""
        if prompt.cloze:
            runs = [score_cloze(self.engine, prompt.cloze, request, calibrated=True)]
            if with_raw:
                raw_request = replace(request, request_id=request.request_id + "-raw")
                runs.append(score_cloze(self.engine, prompt.cloze, raw_request, calibrated=False))
            scores = await asyncio.gather(*runs)
            dist = options_softmax(scores[0], self._sample_option(scores[0], request))
            raw = options_softmax(scores[1]).probs if with_raw else None
            read = len(prompt.cloze.prompt) + sum(map(len, prompt.cloze.options))
            return OptionChoice(dist, raw, read, 0)
        ids = [self.letter_ids[letter] for letter in prompt.option_letters]
        if with_raw:
            raw_request = replace(request, request_id=request.request_id + "-raw", calibrated=False)
            out, raw_out = await asyncio.gather(generate(self.engine, request), generate(self.engine, raw_request))
        else:
            out, raw_out = await generate(self.engine, request), None
        chosen = out.token_ids[0] if out.token_ids else None
        dist = option_distribution(out.top_logprobs[0] if out.top_logprobs else {}, ids, chosen)
        raw = option_distribution(raw_out.top_logprobs[0], ids).probs if raw_out is not None and raw_out.top_logprobs else None
        return OptionChoice(dist, raw, out.prompt_tokens, len(out.token_ids))

    @staticmethod
    def _sample_option(scores: np.ndarray, request: EngineRequest) -> int | None:
        """Greedy requests take the most probable option (None); others sample softmax(scores / temperature)."""
        if request.temperature <= 0:
            return None
        p = options_softmax(scores / request.temperature).probs
        return int(np.random.default_rng(request.seed).choice(len(p), p=p))

    def policy_for(self, domain: str, requested_threshold: float | None = None) -> ResolvedPolicy:
        policy, name = self.policies.for_domain(domain)
        return resolve(policy, name, self.monitor.reference(domain), requested_threshold)

    def option_answer(self, prompt: PreparedPrompt, choice: OptionChoice, domain: str, policy: ResolvedPolicy) -> Answer:
        dist = choice.dist
        options = [OptionProbability(label=l, probability=float(p)) for l, p in zip(prompt.option_letters, dist.probs)]
        raw_conf = float(choice.raw_probs[dist.chosen]) if choice.raw_probs is not None else None
        calibration = self._calibration(dist.confidence, raw_conf, dist.entropy, "multiple_choice", options, domain, policy)
        # The answer's one log-prob is the chosen option's, under the options' distribution, whatever the format.
        return Answer(policy.message if calibration.abstained else prompt.option_letters[dist.chosen], "stop",
                      calibration, choice.prompt_tokens, choice.completion_tokens, [math.log(dist.confidence)])

    def free_answer(self, out: EngineOutput, domain: str, policy: ResolvedPolicy) -> Answer:
        confidence = sequence_confidence(out.token_logprobs)
        calibration = self._calibration(confidence, None, topk_entropy(out.top_logprobs), "free_form", None, domain, policy)
        return Answer(policy.message if calibration.abstained else out.text, out.finish_reason, calibration,
                      out.prompt_tokens, len(out.token_ids), out.token_logprobs)

    def _calibration(self, confidence: float, raw_conf: float | None, entropy: float, mode: str, options,
                     domain: str, policy: ResolvedPolicy) -> Calibration:
        below = confidence < policy.threshold
        abstained = below and policy.action is Action.ABSTAIN
        self.monitor.observe_answer(domain, confidence, entropy, below, abstained)
        return Calibration(
            confidence=confidence, raw_confidence=raw_conf, abstained=abstained, threshold=policy.threshold,
            policy=policy.name, domain=domain, artifact_version=self.engine.artifact_version, mode=mode,
            entropy=entropy, options=options,
        )

    # -- endpoints -----------------------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, domain: str):
        self.check_model(req.model)
        prompt = prepare_chat(self.tokenizer, req, self.artifact.answer_format)
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
        prompt = prepare_completion(self.tokenizer, req, self.artifact.answer_format)
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
        if prompt.multiple_choice:
            answer = self.option_answer(prompt, await self.choose_option(prompt, request, with_raw), domain, policy)
        else:
            answer = self.free_answer(await generate(self.engine, request), domain, policy)
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
                answer = self.free_answer(EngineOutput.collect(deltas), domain, policy)
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


async def score_cloze(engine: EngineClient, tokens: ClozeTokens, request: EngineRequest, calibrated: bool) -> np.ndarray:
    """Each option's cloze score: one greedy one-token request per option token, teacher-forced on the option's
    earlier tokens, returning that token's log-prob. Not restricted to the option tokens, so the log-prob is the
    engine's full-vocabulary softmax of d ⊙ z + l (prompt log-probs would skip the α head inside vLLM)."""
    jobs, owner = [], []
    for k, option in enumerate(tokens.options):
        for j, token in enumerate(option):
            jobs.append(replace(request, request_id=f"{request.request_id}-{k}-{j}", prompt="",
                                prompt_token_ids=tokens.prompt + option[:j], max_tokens=1, temperature=0.0,
                                top_p=1.0, seed=None, option_token_ids=(token,), restrict_to_options=False,
                                calibrated=calibrated))
            owner.append((k, token))
    outs = await asyncio.gather(*(generate(engine, job) for job in jobs))
    per_option: list[list[float]] = [[] for _ in tokens.options]
    for (k, token), out in zip(owner, outs):
        if not out.top_logprobs or token not in out.top_logprobs[0]:
            raise EngineUnavailable("the engine returned no log-prob for an option token")
        per_option[k].append(out.top_logprobs[0][token])
    return cloze_scores(per_option)


def _usage(answer: Answer) -> UsageInfo:
    return UsageInfo(prompt_tokens=answer.prompt_tokens, completion_tokens=answer.completion_tokens,
                     total_tokens=answer.prompt_tokens + answer.completion_tokens)


def _logprobs(answer: Answer) -> dict:
    return {"token_logprobs": [lp if math.isfinite(lp) else None for lp in answer.logprobs]}
