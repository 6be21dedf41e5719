"""Serving logic: engine call, calibrated confidence, policy, metrics and the response record.

Routers stay thin; everything a request does between parsing and the HTTP response happens here.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from adapters.engine import (
    EngineClient, EngineDelta, EngineOutput, EngineRequest, EngineUnavailable, generate, generate_choices,
)
from calm_core.answers import in_cluster, semantic_choice
from calm_core.prompts import LETTERS, AnswerFormatName, ClozeTokens, letter_token_ids
from calm_core.scoring import OptionDistribution, cloze_scores, option_distribution, options_softmax, sequence_confidence, topk_entropy
from gateway.cached import CachedRead
from gateway.errors import APIError
from gateway.group_commit import GroupCommit
from gateway.guarantees import GuaranteedThresholds
from gateway.logprobs import Position, chat_logprobs, completion_logprobs, option_position, token_positions
from gateway.monitoring import DomainMonitor
from gateway.policies import Action, DEFAULT_DOMAIN, Policy, ResolvedPolicy, resolve
from gateway.prompting import PreparedPrompt, prepare_chat, prepare_completion
from gateway.protocol import (
    Calibration, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut, CompletionChoice,
    ClusterOut, CompletionRequest, CompletionResponse, LabelledQuestion, OptionProbability, SamplingFields, UsageInfo,
)
from gateway.settings import GatewaySettings
from gateway.retraining import CaptureBook
from gateway.store import Store


class PolicyBook(CachedRead[dict]):
    """Policies cached from the store (reads are on the hot path): refreshed at once on this replica's admin writes,
    and re-read when older than `max_age_s`, so a change made through another replica sharing the database is in
    force here within that time."""

    def __init__(self, store: Store, max_age_s: float = 5.0, clock=time.monotonic):
        super().__init__(lambda: {d: (Policy.model_validate(body), v) for d, (body, v) in store.list_policies().items()},
                         max_age_s, clock)
        self.refresh()

    def for_domain(self, domain: str) -> tuple[Policy | None, str]:
        policy, key, version = self.in_force(domain)
        return (policy, f"{key}:v{version}") if policy is not None else (None, "builtin")

    def in_force(self, domain: str) -> tuple[Policy | None, str | None, int | None]:
        """The policy that applies to a domain (its own, else the default), with its key and version."""
        policies = self.get()
        for key in (domain, DEFAULT_DOMAIN):
            if key in policies:
                policy, version = policies[key]
                return policy, key, version
        return None, None, None


@dataclass(frozen=True)
class ServedArtifact:
    """What the gateway needs to know about the served artifact to route a request through it."""

    answer_format: AnswerFormatName = "letter"  # how its head was fitted to multiple choice
    multiple_choice_only: bool = False  # fitted to multiple choice: free-form answers need a free-form mode
    has_adapter: bool = False
    free_form_version: str | None = None  # the free-form mode inside the artifact (its own weights and head)

    @classmethod
    def of(cls, manifest) -> "ServedArtifact":
        return cls(manifest.answer_format, manifest.applies_to == "multiple_choice", manifest.has_adapter,
                   manifest.free_form_version)


@dataclass
class OptionChoice:
    """Multiple-choice decisions: the calibrated options' distribution with one chosen option per requested choice,
    the raw distribution if asked, and the token counts."""

    dists: list[OptionDistribution]
    raw_probs: np.ndarray | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Answer:
    """One choice of a response, whatever its wire format."""

    text: str
    finish_reason: str | None
    calibration: Calibration
    completion_tokens: int
    # The answer's log-prob positions, built only when a client asks for log-probs (decoding every alternative of
    # every token would otherwise cost each response).
    positions: Callable[[], list[Position]]


@dataclass
class Served:
    """A whole response: its id, one answer per choice, and the prompt's token count."""

    response_id: str
    answers: list[Answer]
    prompt_tokens: int

    def usage(self) -> UsageInfo:
        completion = sum(a.completion_tokens for a in self.answers)
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                         total_tokens=self.prompt_tokens + completion)


def response_key(response_id: str, choice_index: int) -> str:
    """The stored id of one choice (feedback names a response and, for n > 1, a choice)."""
    return response_id if choice_index == 0 else f"{response_id}#{choice_index}"


def prompt_token_bound(text: str) -> int:
    """At least as many as the prompt's tokens, without tokenizing: a token of a byte-level BPE covers at least one
    byte, and a SentencePiece tokenizer adds at most one (its dummy prefix). Tokenizing costs more than the rest of
    preparing a short free-form request, and most prompts are far from the context limit."""
    return len(text.encode()) + 1


class CalibratedService:
    def __init__(self, settings: GatewaySettings, engine: EngineClient, tokenizer, store: Store, monitor: DomainMonitor,
                 artifact: ServedArtifact = ServedArtifact(), policies: PolicyBook | None = None,
                 guarantees: GuaranteedThresholds | None = None, capture: "CaptureBook | None" = None,
                 responses: GroupCommit | None = None):
        self.settings = settings
        self.artifact = artifact
        self.engine = engine
        self.tokenizer = tokenizer
        self.store = store
        self.monitor = monitor
        # Shared by every version's service (gateway/deployments.py): policies, risk fits and capture are per domain.
        self.policies = policies or PolicyBook(store)
        self.responses = responses or GroupCommit(lambda rows: store.record_responses(rows))  # for feedback
        self.guarantees = guarantees or GuaranteedThresholds(store, monitor.metrics, self.policies.in_force,
                                                             monitor.reference, settings.risk_refit_every)
        self.capture = capture
        self.letter_ids = dict(zip(LETTERS, letter_token_ids(tokenizer)))
        self.one_pass = artifact.answer_format == "cloze" and getattr(engine, "folded_scoring", False)
        # Free-form answers from the artifact's free-form mode where the engine serves it; else, for an artifact fitted
        # to multiple choice only, from the base weights without a head.
        self.free_form_mode = artifact.free_form_version is not None and getattr(engine, "free_form_mode", False)

    def scoring_paths(self) -> dict[str, str]:
        """How each kind of answer is scored, for /health."""
        if self.artifact.answer_format == "letter":
            mc = "letter: one request per question, α head in the logits processor"
        elif self.one_pass:
            mc = "cloze one-pass: one request per option, prompt log-probs of weights with the α head folded in"
        else:
            mc = "cloze per-token: one request per option token, α head in the logits processor"
        if self.free_form_mode:
            free = (f"free-form mode {self.artifact.free_form_version}: its adapter merged, its α head in the logits "
                    "processor; raw confidence from the same weights' prompt log-probs of the answer")
        elif self.artifact.multiple_choice_only:
            free = "base weights, no α head"
        else:
            free = "α head in the logits processor"
        return {"multiple_choice": mc, "free_form": free}

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
        if prompt.multiple_choice and (shaping := req.shaping_parameters()):
            raise APIError(400, f"{shaping[0]} does not apply to multiple-choice answers (the answer is an option "
                           "chosen from the options' calibrated distribution; temperature and seed apply)",
                           param=shaping[0])
        if prompt.cloze:
            # The longest scoring request: the prompt and all but the last token of the longest option, plus one.
            n_prompt, budget = len(prompt.cloze.prompt) + max(map(len, prompt.cloze.options)) - 1, 1
        else:
            budget = 1 if prompt.multiple_choice else max_tokens
            n_prompt = prompt_token_bound(prompt.text)
            if n_prompt + budget > self.engine.max_model_len:  # may not fit: count exactly
                n_prompt = len(self.tokenizer.encode(prompt.text, add_special_tokens=False))
        if n_prompt + budget > self.engine.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens; the request "
                           f"has {n_prompt} prompt tokens and asks for {budget} more", param="messages",
                           code="context_length_exceeded")
        # The artifact's weights and head serve the answers they were fitted for.
        free_form = not prompt.multiple_choice and self.free_form_mode
        fitted = prompt.multiple_choice or not self.artifact.multiple_choice_only
        common = dict(request_id=uuid.uuid4().hex, prompt=prompt.text, temperature=req.temperature or 0.0,
                      top_p=req.top_p or 1.0, seed=req.seed, calibrated=fitted or free_form,
                      adapter=fitted and self.artifact.has_adapter and not free_form, free_form=free_form, n=req.n)
        if prompt.cloze:
            return EngineRequest(**common, max_tokens=1)  # a template: choose_option sends one request per option token
        if prompt.multiple_choice:
            ids = tuple(self.letter_ids[letter] for letter in prompt.option_letters)
            return EngineRequest(**common, max_tokens=1, option_token_ids=ids)
        return EngineRequest(**common, max_tokens=max_tokens, stop=req.stop_list(),
                             top_logprobs=max(top_logprobs, self.settings.default_top_logprobs),
                             **self._shaping(req))

    def _shaping(self, req: SamplingFields) -> dict:
        """Free-form sampling parameters for the engine, checked where the engine's own error would not name them."""
        bias = tuple((int(t), float(b)) for t, b in (req.logit_bias or {}).items())
        vocab = len(self.tokenizer)
        if any(t >= vocab for t, _ in bias):
            raise APIError(400, f"logit_bias names a token id outside the vocabulary (size {vocab})", param="logit_bias")
        fmt = req.response_format
        return dict(
            top_k=req.top_k if req.top_k not in (None, -1) else 0, min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0, logit_bias=bias,
            json_schema=json.dumps(fmt.json_schema.schema_) if fmt is not None and fmt.type == "json_schema" else None,
            json_object=fmt is not None and fmt.type == "json_object",
        )

    # -- confidence and policy -----------------------------------------------------------------------------------
    def wants_raw(self, req: SamplingFields) -> bool:
        if req.calm is not None and req.calm.raw_confidence is not None:
            return req.calm.raw_confidence
        return self.settings.raw_confidence

    async def choose_option(self, prompt: PreparedPrompt, request: EngineRequest, with_raw: bool) -> OptionChoice:
        """The calibrated options' distribution (one chosen option per choice) and, if asked, the raw model's
        (the same requests, α head skipped)."""
        if prompt.cloze:
            score = score_cloze_one_pass if self.one_pass else score_cloze
            runs = [score(self.engine, prompt.cloze, request, calibrated=True)]
            if with_raw:
                raw_request = replace(request, request_id=request.request_id + "-raw")
                runs.append(score(self.engine, prompt.cloze, raw_request, calibrated=False))
            scores = await asyncio.gather(*runs)
            dists = [options_softmax(scores[0], chosen) for chosen in self._sample_options(scores[0], request)]
            raw = options_softmax(scores[1]).probs if with_raw else None
            read = len(prompt.cloze.prompt) + sum(map(len, prompt.cloze.options))
            return OptionChoice(dists, raw, read, 0)
        ids = [self.letter_ids[letter] for letter in prompt.option_letters]
        if with_raw:
            raw_request = replace(request, request_id=request.request_id + "-raw", calibrated=False, n=1)
            outs, raw_out = await asyncio.gather(generate_choices(self.engine, request), generate(self.engine, raw_request))
        else:
            outs, raw_out = await generate_choices(self.engine, request), None
        dists = [option_distribution(out.top_logprobs[0] if out.top_logprobs else {}, ids,
                                     out.token_ids[0] if out.token_ids else None) for out in outs]
        raw = option_distribution(raw_out.top_logprobs[0], ids).probs if raw_out is not None and raw_out.top_logprobs else None
        return OptionChoice(dists, raw, outs[0].prompt_tokens, sum(len(o.token_ids) for o in outs))

    @staticmethod
    def _sample_options(scores: np.ndarray, request: EngineRequest) -> list[int | None]:
        """Greedy requests take the most probable option (None) every time; others sample n options from
        softmax(scores / temperature)."""
        if request.temperature <= 0:
            return [None] * request.n
        p = options_softmax(scores / request.temperature).probs
        return [int(i) for i in np.random.default_rng(request.seed).choice(len(p), size=request.n, p=p)]

    def policy_for(self, domain: str, requested_threshold: float | None = None) -> ResolvedPolicy:
        policy, name = self.policies.for_domain(domain)
        return resolve(policy, name, self.monitor.reference(domain), requested_threshold, self.guarantees.fit_for(domain))

    def option_answers(self, prompt: PreparedPrompt, choice: OptionChoice, domain: str, policy: ResolvedPolicy) -> list[Answer]:
        answers = []
        letters = prompt.option_letters
        for dist in choice.dists:
            options = [OptionProbability(label=l, probability=float(p)) for l, p in zip(letters, dist.probs)]
            raw_conf = float(choice.raw_probs[dist.chosen]) if choice.raw_probs is not None else None
            calibration = self._calibration(dist.confidence, raw_conf, dist.entropy, "multiple_choice", options, domain, policy)
            # The answer's one log-prob is the chosen option's, under the options' distribution, whatever the format.
            answers.append(Answer(policy.message if calibration.abstained else letters[dist.chosen], "stop", calibration,
                                  choice.completion_tokens // len(choice.dists),
                                  lambda d=dist: [option_position(letters, d.probs, d.chosen)]))
        return answers

    async def free_answers(self, outs: list[EngineOutput], request: EngineRequest, domain: str, policy: ResolvedPolicy,
                           with_raw: bool) -> list[Answer]:
        # Raw token confidence needs prompt log-probs (in-process engines); elsewhere it stays null.
        if with_raw and getattr(self.engine, "prompt_logprobs", False):
            raws = await asyncio.gather(*(self.raw_token_confidence(o, request, i) for i, o in enumerate(outs)))
        else:
            raws = [None] * len(outs)
        return [self.free_answer(o, domain, policy, raw) for o, raw in zip(outs, raws)]

    async def raw_token_confidence(self, out: EngineOutput, request: EngineRequest, index: int = 0) -> float | None:
        """The token confidence of the same answer without the α head: the prompt log-probs of prompt + answer on the
        same weights (one prefill, no generation; prompt log-probs are taken before logits processors)."""
        if not out.token_ids:
            return None
        prompt_ids = list(request.prompt_token_ids) or self.tokenizer.encode(request.prompt, add_special_tokens=False)
        raw = await generate(self.engine, EngineRequest(
            request_id=f"{request.request_id}-raw{index}", prompt="", prompt_token_ids=tuple(prompt_ids + out.token_ids),
            max_tokens=1, prompt_logprobs=True, calibrated=False, adapter=request.adapter, free_form=request.free_form))
        lps = (raw.prompt_logprobs or [])[len(prompt_ids):]
        if len(lps) != len(out.token_ids):
            raise EngineUnavailable("the engine returned no prompt log-probs for the answer")
        return sequence_confidence(lps)

    def free_answer(self, out: EngineOutput, domain: str, policy: ResolvedPolicy, raw: float | None = None) -> Answer:
        confidence = sequence_confidence(out.token_logprobs)
        calibration = self._calibration(confidence, raw, topk_entropy(out.top_logprobs), "free_form", None, domain, policy,
                                        method="token")
        return Answer(policy.message if calibration.abstained else out.text, out.finish_reason, calibration,
                      len(out.token_ids), partial(self.positions, out))

    def positions(self, out: EngineOutput | EngineDelta) -> list[Position]:
        return token_positions(out.token_ids, out.token_logprobs, out.top_logprobs, self.token_text)

    def token_text(self, token_id: int) -> str:
        # vLLM's OpenAI server decodes each token alone (byte-level BPE tokenizers need no leading-space repair).
        return self.tokenizer.decode([token_id])

    def _calibration(self, confidence: float, raw_conf: float | None, entropy: float, mode: str, options,
                     domain: str, policy: ResolvedPolicy, method: str | None = None, clusters=None) -> Calibration:
        below = policy.below(confidence)
        abstained = below and policy.action is Action.ABSTAIN
        self.monitor.observe_answer(domain, confidence, entropy, below, abstained)
        return Calibration(
            confidence=confidence, raw_confidence=raw_conf, abstained=abstained, threshold=policy.threshold,
            policy=policy.name, domain=domain, artifact_version=self.engine.artifact_version, mode=mode,
            entropy=entropy, options=options, policy_state=policy.state, method=method, clusters=clusters,
        )

    async def score_labelled(self, domain: str, questions: list[LabelledQuestion], concurrency: int = 8) -> list[bool]:
        """Score labelled questions as served answers (greedy, calibrated, no raw pass) and store each one's
        confidence and verdict as a label of the domain; neither metrics nor drift windows see them."""
        limit = asyncio.Semaphore(concurrency)

        async def one(q: LabelledQuestion) -> bool:
            req = ChatCompletionRequest(model=self.engine.model_name, options=q.options,
                                        messages=[{"role": "user", "content": q.question}])
            prompt = prepare_chat(self.tokenizer, req, self.artifact.answer_format)
            async with limit:
                choice = await self.choose_option(prompt, self.engine_request(req, prompt, 1, 0), with_raw=False)
            dist = choice.dists[0]
            response_id = f"label-{uuid.uuid4().hex}"

            def store() -> None:  # off the event loop, like every other write
                self.store.record_response(response_id, domain, dist.confidence)
                self.store.add_feedback(response_id, dist.chosen == q.answer)

            await asyncio.to_thread(store)
            return dist.chosen == q.answer

        verdicts = await asyncio.gather(*(one(q) for q in questions))
        self.guarantees.refit_domain(domain)
        return list(verdicts)

    # -- endpoints -----------------------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, domain: str):
        self.check_model(req.model)
        prompt = prepare_chat(self.tokenizer, req, self.artifact.answer_format)
        max_tokens = req.max_completion_tokens or req.max_tokens or 256
        view = WireView(chat=True, model=req.model, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        served = await self._serve(req, domain, prompt, max_tokens, req.top_logprobs or 0, view)
        if not isinstance(served, Served):
            return served
        return ChatCompletionResponse(
            id=served.response_id, model=req.model, usage=served.usage(),
            choices=[ChatChoice(index=i, message=ChatMessageOut(content=a.text), finish_reason=a.finish_reason,
                                logprobs=view.chat_logprobs(a.positions), calibration=a.calibration)
                     for i, a in enumerate(served.answers)],
        )

    async def completion(self, req: CompletionRequest, domain: str):
        self.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs would return the prompt's log-probs, which are taken before the α "
                           "head (not calibrated); ask for one of them", param="echo")
        prompt = prepare_completion(self.tokenizer, req, self.artifact.answer_format)
        view = WireView(chat=False, model=req.model, logprobs=req.logprobs, echo=req.prompt if req.echo else "")
        served = await self._serve(req, domain, prompt, req.max_tokens, req.logprobs or 0, view)
        if not isinstance(served, Served):
            return served
        return CompletionResponse(
            id=served.response_id, model=req.model, usage=served.usage(),
            choices=[CompletionChoice(index=i, text=view.echo + a.text, finish_reason=a.finish_reason,
                                      logprobs=view.completion_logprobs(a.positions), calibration=a.calibration)
                     for i, a in enumerate(served.answers)],
        )

    async def _serve(self, req: SamplingFields, domain: str, prompt: PreparedPrompt, max_tokens: int, top: int,
                     view: "WireView"):
        """The Served response, or the SSE stream when the request streams."""
        request = self.engine_request(req, prompt, max_tokens, top)
        policy = self.policy_for(domain, req.calm.threshold if req.calm else None)
        response_id = f"{'chatcmpl' if view.chat else 'cmpl'}-{request.request_id}"
        samples = self.semantic_samples(req, domain) if not prompt.multiple_choice else None
        if samples and req.n > 1:
            raise APIError(400, "semantic confidence answers one question with one choice drawn from its samples; "
                           "n must be 1", param="n")
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            self._capture(req, prompt, domain, None)
            return self._stream(response_id, view, prompt, request, domain, policy, self.wants_raw(req), usage, samples)
        served = await self._complete(prompt, request, domain, policy, response_id, self.wants_raw(req), samples)
        self._capture(req, prompt, domain, served.answers[0].text)
        return served

    def _capture(self, req: SamplingFields, prompt: PreparedPrompt, domain: str, answer: str | None) -> None:
        """Keep the question (and options) for retraining where the domain opted in; off the event loop."""
        if self.capture is not None:
            kind = "multiple_choice" if prompt.multiple_choice else "free_form"
            self.capture.add(domain, kind, req.question_text(), list(req.options or []) or None, answer)

    def semantic_samples(self, req: SamplingFields, domain: str) -> int | None:
        """How many answers to sample when the free-form confidence is semantic (request, else the domain's policy)."""
        policy, _ = self.policies.for_domain(domain)
        method = (req.calm.confidence if req.calm and req.calm.confidence else None) or (
            policy.confidence if policy else "token")
        if method != "semantic":
            return None
        return (req.calm.samples if req.calm and req.calm.samples else None) or (
            policy.samples if policy else Policy.model_fields["samples"].default)

    async def semantic_answer(self, request: EngineRequest, samples: int, domain: str, policy: ResolvedPolicy,
                              with_raw: bool) -> tuple[Answer, int]:
        """n answers sampled in one engine call, grouped by meaning; the answer is the largest group's most probable
        member and its confidence the group's share. Raw: the share of that group among samples without the head."""
        sampled = replace(request, n=samples, temperature=request.temperature or 1.0)
        runs = [generate_choices(self.engine, sampled)]
        if with_raw:
            runs.append(generate_choices(self.engine, replace(sampled, request_id=request.request_id + "-raw",
                                                              calibrated=False)))
        outs, *raw = await asyncio.gather(*runs)
        choice = semantic_choice([o.text for o in outs], [sequence_confidence(o.token_logprobs) for o in outs])
        top = choice.clusters[0]
        raw_conf = (sum(in_cluster(o.text, top) for o in raw[0]) / len(raw[0])) if raw else None
        listed = [ClusterOut(answer=outs[i].text, size=c.size) for i, c in zip(choice.best, choice.clusters)]
        calibration = self._calibration(choice.confidence, raw_conf, choice.entropy, "free_form", None, domain, policy,
                                        method="semantic", clusters=listed)
        out = outs[choice.answer]
        text = policy.message if calibration.abstained else out.text
        answer = Answer(text, out.finish_reason, calibration, sum(len(o.token_ids) for o in outs),
                        partial(self.positions, out))
        return answer, outs[0].prompt_tokens

    async def _complete(self, prompt, request, domain, policy, response_id, with_raw, samples=None) -> Served:
        if prompt.multiple_choice:
            choice = await self.choose_option(prompt, request, with_raw)
            served = Served(response_id, self.option_answers(prompt, choice, domain, policy), choice.prompt_tokens)
        elif samples:
            answer, prompt_tokens = await self.semantic_answer(request, samples, domain, policy, with_raw)
            served = Served(response_id, [answer], prompt_tokens)
        else:
            outs = await generate_choices(self.engine, request)
            served = Served(response_id, await self.free_answers(outs, request, domain, policy, with_raw),
                            outs[0].prompt_tokens)
        await self._record(served, domain)
        return served

    async def _record(self, served: Served, domain: str) -> None:
        """Store the choices' confidences (for feedback) off the event loop: a database write must not stall the
        requests being served meanwhile."""
        rows = [(response_key(served.response_id, i), domain, a.calibration.confidence) for i, a in enumerate(served.answers)]
        await self.responses.add(rows)

    async def _stream(self, response_id, view, prompt, request, domain, policy, with_raw, include_usage,
                      samples=None) -> AsyncIterator[str]:
        """SSE chunks in OpenAI's shape; each choice's calibration object arrives with its final chunk.

        Multiple choice, semantic confidence and abstain policies need the whole answer before any text may be shown,
        so those are buffered; free-form answers under an annotate policy stream token by token. Errors propagate: the
        app turns them into an SSE error event (gateway/app.py).
        """
        created = int(time.time())

        def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
            body = {"id": response_id, "object": view.chunk_object, "created": created, "model": view.model,
                    "choices": choices}
            if usage is not None:
                body["usage"] = usage.model_dump()
            return f"data: {json.dumps(body)}\n\n"

        try:
            if view.chat:
                yield chunk([view.role_delta(i) for i in range(request.n)])
            if prompt.multiple_choice or samples or policy.action is Action.ABSTAIN:
                served = await self._complete(prompt, request, domain, policy, response_id, with_raw, samples)
                for i, answer in enumerate(served.answers):
                    yield chunk([view.delta(i, answer.text, answer.positions, first=True)])
                    yield chunk([view.finish(i, answer)])
            else:
                deltas, started = [], set()
                async for delta in self.engine.stream(request):
                    deltas.append(delta)
                    if delta.text or delta.token_ids:
                        positions = partial(self.positions, delta)
                        yield chunk([view.delta(delta.index, delta.text, positions, first=delta.index not in started)])
                        started.add(delta.index)
                outs = EngineOutput.collect_choices(deltas, request.n)
                served = Served(response_id, await self.free_answers(outs, request, domain, policy, with_raw),
                                outs[0].prompt_tokens)
                await self._record(served, domain)
                for i, answer in enumerate(served.answers):
                    yield chunk([view.finish(i, answer)])
            if include_usage:
                yield chunk([], served.usage())
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            await self.engine.abort(request.request_id)
            raise


@dataclass
class WireView:
    """How answers look on the wire for one request: chat or completions, log-probs asked (top-k count, or None for
    none), and the echoed prompt (completions)."""

    chat: bool
    model: str
    logprobs: int | None
    echo: str = ""
    _offsets: dict[int, int] = field(default_factory=dict)  # streamed completions: text offset per choice so far

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chat_logprobs(self, positions: Callable[[], list[Position]]):
        return chat_logprobs(positions(), self.logprobs) if self.logprobs is not None else None

    def completion_logprobs(self, positions: Callable[[], list[Position]], text_offset: int = 0):
        return completion_logprobs(positions(), self.logprobs, text_offset) if self.logprobs is not None else None

    def role_delta(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, text: str, positions: Callable[[], list[Position]], first: bool) -> dict:
        if self.chat:
            lp = self.chat_logprobs(positions)
            return {"index": index, "delta": {"content": text} if text else {},
                    "logprobs": lp.model_dump() if lp is not None else None, "finish_reason": None}
        lp = None
        if self.logprobs is not None:
            built = positions()
            lp = completion_logprobs(built, self.logprobs, self._offsets.get(index, 0))
            self._offsets[index] = self._offsets.get(index, 0) + sum(len(p.token) for p in built)
        return {"index": index, "text": (self.echo if first else "") + text,
                "logprobs": lp.model_dump() if lp is not None else None, "finish_reason": None}

    def finish(self, index: int, answer: Answer) -> dict:
        body = {"index": index, "finish_reason": answer.finish_reason, "logprobs": None,
                "calibration": answer.calibration.model_dump()}
        if self.chat:
            body["delta"] = {}
        else:
            body["text"] = ""
        return body


async def score_cloze(engine: EngineClient, tokens: ClozeTokens, request: EngineRequest, calibrated: bool) -> np.ndarray:
    """Each option's cloze score: one greedy one-token request per option token, teacher-forced on the option's
    earlier tokens, returning that token's log-prob. Not restricted to the option tokens, so the log-prob is the
    engine's full-vocabulary softmax of d ⊙ z + l (prompt log-probs would skip the α head inside vLLM)."""
    jobs, owner = [], []
    for k, option in enumerate(tokens.options):
        for j, token in enumerate(option):
            jobs.append(replace(request, request_id=f"{request.request_id}-{k}-{j}", prompt="",
                                prompt_token_ids=tokens.prompt + option[:j], max_tokens=1, temperature=0.0,
                                top_p=1.0, seed=None, n=1, option_token_ids=(token,), restrict_to_options=False,
                                calibrated=calibrated))
            owner.append((k, token))
    outs = await asyncio.gather(*(generate(engine, job) for job in jobs))
    per_option: list[list[float]] = [[] for _ in tokens.options]
    for (k, token), out in zip(owner, outs):
        if not out.top_logprobs or token not in out.top_logprobs[0]:
            raise EngineUnavailable("the engine returned no log-prob for an option token")
        per_option[k].append(out.top_logprobs[0][token])
    return cloze_scores(per_option)


async def score_cloze_one_pass(engine: EngineClient, tokens: ClozeTokens, request: EngineRequest, calibrated: bool) -> np.ndarray:
    """Each option's cloze score from one request per option: the prompt log-probs of the option's tokens after the
    question. Prompt log-probs skip logits processors, so the calibrated run reads the engine whose weights carry the
    α head (`folded`) and the raw run the unfolded weights, the processor switched off in both."""
    n_prompt = len(tokens.prompt)
    jobs = [replace(request, request_id=f"{request.request_id}-{k}", prompt="", prompt_token_ids=tokens.prompt + option,
                    max_tokens=1, temperature=0.0, top_p=1.0, seed=None, n=1, option_token_ids=(), top_logprobs=0,
                    prompt_logprobs=True, folded=calibrated, calibrated=False)
            for k, option in enumerate(tokens.options)]
    outs = await asyncio.gather(*(generate(engine, job) for job in jobs))
    per_option = []
    for option, out in zip(tokens.options, outs):
        lps = (out.prompt_logprobs or [])[n_prompt : n_prompt + len(option)]
        if len(lps) != len(option) or not all(math.isfinite(lp) for lp in lps):
            raise EngineUnavailable("the engine returned no prompt log-probs for an option")
        per_option.append(lps)
    return cloze_scores(per_option)
