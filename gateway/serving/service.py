"""The request path of one served version: prepare → scorer → policy → record → respond.

`prepare_chat` / `prepare_completion` check the request and build its `RequestContext` (prompt, domain, policy,
scorer, scoring job, wire view); `complete` and `stream` are the two ways to answer it, over the same steps: the
scorer (calm_core/scorers/) turns the engine's outputs into confidences, `calibrate` applies the domain's policy and
observes the answer, `record` stores each choice's confidence for feedback, and the wire view (gateway/serving/wire.py)
writes the response or its SSE chunks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

from calm_core.engine import EngineClient, EngineDelta
from calm_core.prompts import PreparedPrompt
from calm_core.scorers.base import AnswerKind, ConfidenceMethod, ScoredChoice, Scoring, ScoringJob, ScoringPath
from calm_core.scorers.registry import Scorers
from calm_core.served_answers import ServedAnswer
from gateway.errors import APIError
from gateway.serving.escalation import Escalator
from gateway.records.group_commit import GroupCommit
from gateway.policy.guarantees import GuaranteedThresholds
from gateway.serving.handoff import Handoff
from gateway.records.handoff_store import HandoffStore
from gateway.serving.logprobs import Position, option_position, token_positions
from gateway.observe.monitoring import DomainMonitor
from gateway.policy.policies import Action, Policy, resolve
from gateway.policy.policy_book import PolicyBook
from gateway.serving.prepare import RequestPlanner, ServedArtifact
from gateway.serving.prompting import prepare_chat, prepare_completion
from gateway.protocol.openai import (
    Calibration, ChatCompletionRequest, ClusterOut, CompletionRequest, OptionProbability, SamplingFields,
)
from gateway.serving.retraining import CaptureBook
from gateway.settings import GatewaySettings, peer_secret
from gateway.records.store import Store
from gateway.policy.targets import Targets
from gateway.serving.context import Caller, Numbering, RequestContext
from gateway.serving.wire import Answer, Served, WireView, no_positions


@dataclass
class SharedParts:
    """What every version's service shares (policies, risk fits, capture and the response writer are per domain)."""

    settings: GatewaySettings
    tokenizer: object
    store: Store
    monitor: DomainMonitor
    policies: PolicyBook
    guarantees: GuaranteedThresholds
    capture: CaptureBook | None
    responses: GroupCommit
    handoff: Handoff

    @classmethod
    def build(cls, settings: GatewaySettings, tokenizer, store: Store, monitor: DomainMonitor,
              capture: CaptureBook | None = None, alone: Callable[[], bool] = lambda: False) -> "SharedParts":
        """`alone`: no other request in flight, when a response's record may be written on the event loop."""
        policies = PolicyBook(store)
        guarantees = GuaranteedThresholds(store, monitor.metrics, policies.in_force, monitor.reference,
                                          settings.risk_refit_every)
        responses = GroupCommit(lambda rows: store.record_responses(rows),
                                (lambda rows: store.record_responses(rows, wait=False)) if store.sqlite else None, alone)
        return cls(settings, tokenizer, store, monitor, policies, guarantees, capture, responses,
                   Handoff(HandoffStore(store), monitor.metrics, Escalator(peer_secret(settings), Targets(settings.targets))))

    def record_verdict(self, response_key: str, domain: str, correct: bool, key_id: str | None = None) -> bool | None:
        """Feedback on a stored answer (from the key `key_id`), then the domain's online calibration and guarantee see it
        (blocking: call it off the event loop). True stored now, False the same verdict was stored, None another one
        was."""
        stored = self.store.add_feedback(response_key, correct, key_id)
        if stored:
            self.verdict_recorded(domain, correct)
        return stored

    def verdict_recorded(self, domain: str, correct: bool) -> None:
        confidences, outcomes = self.store.recent_feedback(domain, self.settings.feedback_window)
        self.monitor.observe_feedback(domain, correct, confidences, outcomes)
        self.guarantees.on_feedback(domain)


class CalibratedService:
    """One served version: its engine, its scorers, and the shared parts."""

    def __init__(self, engine: EngineClient, artifact: ServedArtifact, shared: SharedParts):
        self.engine, self.artifact, self.shared = engine, artifact, shared
        self.settings, self.tokenizer, self.monitor = shared.settings, shared.tokenizer, shared.monitor
        self.planner = RequestPlanner(shared.settings, engine, shared.tokenizer, artifact)
        self.scorers = Scorers(engine, shared.tokenizer, artifact.answer_format, artifact.post_hoc)

    def scoring_paths(self) -> dict[str, str]:
        """How each kind of answer is scored, for /health."""
        if not self.settings.free_form_answers:
            free = "refused: this gateway serves multiple-choice answers only (CALM_ANSWERS=multiple_choice)"
        elif self.planner.free_form_mode:
            # in process its adapter is merged into an engine of its own; upstream it is the engines' run-time LoRA
            upstream = self.engine.describe().get("adapter") == "run-time lora"
            adapter = "as a vLLM LoRA loaded at run time" if upstream else "merged"
            raw = ("raw confidence (when asked) from the same weights' prompt log-probs of the answer"
                   if self.engine.prompt_logprobs else "no raw confidence (this engine returns no prompt log-probs)")
            free = (f"free-form mode {self.artifact.free_form_version}: its adapter {adapter}, its α head in the "
                    f"logits processor; {raw}")
        elif self.artifact.multiple_choice_only:
            free = "base weights, no α head"
        else:
            free = "α head in the logits processor"
        options = self.scorers[self.scorers.multiple_choice].description
        if getattr(self.engine, "prefix_reuse", False) and self.scorers.multiple_choice is ScoringPath.CLOZE_ONE_PASS:
            options += (f"; questions of {self.engine.prefix_block}+ tokens are read once: the options after the first "
                        "read them from vLLM's prefix cache")
        return {"multiple_choice": options, "free_form": free}

    # -- prepare ------------------------------------------------------------------------------------------------------
    def domain_of(self, req: SamplingFields, header: str | None) -> str:
        raw = (req.calm.domain if req.calm and req.calm.domain else None) or (req.metadata or {}).get("domain") or header
        return self.monitor.label(raw)

    def prepare_chat(self, req: ChatCompletionRequest, domain: str, caller: Caller,
                     id_prefix: str = "chatcmpl-") -> RequestContext:
        self.check_model(req.model)
        prompt = prepare_chat(self.tokenizer, req, self.artifact.answer_format)
        view = WireView(chat=True, model=req.model, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        return self._context(req, domain, prompt, req.max_completion_tokens or req.max_tokens or 256,
                             req.top_logprobs or 0, view, caller, Numbering(), id_prefix)

    def prepare_completion(self, req: CompletionRequest, domain: str, caller: Caller,
                           numbering: Numbering = Numbering()) -> RequestContext:
        self.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs would return the prompt's log-probs, which are taken before the α "
                           "head (not calibrated); ask for one of them", param="echo")
        prompt = prepare_completion(self.tokenizer, req, self.artifact.answer_format)
        view = WireView(chat=False, model=req.model, logprobs=req.logprobs, echo=req.prompt if req.echo else "")
        return self._context(req, domain, prompt, req.max_tokens, req.logprobs or 0, view, caller, numbering, "cmpl-")

    def check_model(self, name: str) -> None:
        if name != self.engine.model_name:
            raise APIError(404, f"model {name!r} does not exist; this gateway serves {self.engine.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def _context(self, req: SamplingFields, domain: str, prompt: PreparedPrompt, max_tokens: int, top: int,
                 view: WireView, caller: Caller, numbering: Numbering, id_prefix: str) -> RequestContext:
        request = self.planner.template(req, prompt, max_tokens, top)
        in_force, name = self.shared.policies.for_domain(domain)  # read once: the threshold and the method
        policy = resolve(in_force, name, self.monitor.reference(domain), req.calm.threshold if req.calm else None,
                         self.shared.guarantees.fit_for(domain))
        method, samples = self._method(req, in_force)
        scorer = self.scorers.for_prompt(prompt, method)
        job = ScoringJob(prompt, request, self._wants_raw(req, scorer.kind), samples)
        return RequestContext(req, domain, prompt, scorer, job, policy, view,
                              numbering.response_id or f"{id_prefix}{request.request_id}", caller, numbering)

    def _method(self, req: SamplingFields, policy: Policy | None) -> tuple[ConfidenceMethod, int]:
        """The free-form confidence method and its sample count: the request's, else the domain's policy's."""
        asked = req.calm.confidence if req.calm and req.calm.confidence else None
        method = ConfidenceMethod(asked or (policy.confidence if policy else ConfidenceMethod.TOKEN))
        samples = (req.calm.samples if req.calm and req.calm.samples else None) or (
            policy.samples if policy else Policy.model_fields["samples"].default)
        return method, samples if method is ConfidenceMethod.SEMANTIC else 0

    def _wants_raw(self, req: SamplingFields, kind: AnswerKind) -> bool:
        if req.calm is not None and req.calm.raw_confidence is not None:
            return req.calm.raw_confidence
        return self.settings.free_form_raw_confidence if kind is AnswerKind.FREE_FORM else self.settings.raw_confidence

    # -- policy, record -----------------------------------------------------------------------------------------------
    def calibrate(self, scoring: Scoring, ctx: RequestContext) -> Served:
        """The policy applied to each scored choice, the answer observed by the domain's monitor."""
        answers = [self._answer(choice, scoring, ctx) for choice in scoring.choices]
        return Served(ctx.response_id, answers, scoring.prompt_tokens, ctx.numbering.first_index)

    def _answer(self, choice: ScoredChoice, scoring: Scoring, ctx: RequestContext) -> Answer:
        policy, letters = ctx.policy, ctx.prompt.option_letters
        below = policy.below(choice.confidence)
        abstained = below and policy.action is Action.ABSTAIN
        self.monitor.observe_answer(ctx.domain, choice.confidence, choice.entropy, below, abstained, ctx.caller.drift)
        options = ([OptionProbability(label=label, probability=p) for label, p in zip(letters, choice.option_probs)]
                   if choice.option_probs is not None else None)
        clusters = [ClusterOut(answer=a, size=n) for a, n in choice.clusters] if choice.clusters is not None else None
        calibration = Calibration(
            confidence=choice.confidence, raw_confidence=choice.raw_confidence, abstained=abstained,
            threshold=policy.threshold, policy=policy.name, domain=ctx.domain,
            artifact_version=self.engine.artifact_version, mode=scoring.kind.value, entropy=choice.entropy,
            options=options, policy_state=policy.state, method=scoring.method.value if scoring.method else None,
            clusters=clusters)
        # What a verdict on this answer is a label for (training/retrain/labelled.py): the options' scores under the
        # option temperature, a free-form answer's token confidence under the token temperature.
        served = None
        if choice.option_probs is not None:
            served = ServedAnswer(self.engine.artifact_version, scoring.kind.value, choice.confidence, None,
                                  choice.chosen, choice.option_probs)
        elif scoring.method is ConfidenceMethod.TOKEN:
            served = ServedAnswer(self.engine.artifact_version, scoring.kind.value, choice.confidence, "token")
        return Answer(policy.message if abstained else choice.text, choice.finish_reason, calibration,
                      choice.completion_tokens, no_positions if abstained else self._positions(choice, letters), served)

    def _positions(self, choice: ScoredChoice, letters):
        if choice.output is None:  # the answer's one log-prob is the chosen option's, under the options' distribution
            return lambda: [option_position(letters, choice.option_probs, choice.chosen)]
        return partial(self.positions, choice.output)

    def positions(self, out) -> list[Position]:
        # vLLM's OpenAI server decodes each token alone (byte-level BPE tokenizers need no leading-space repair).
        return token_positions(out.token_ids, out.token_logprobs, out.top_logprobs,
                               lambda token_id: self.tokenizer.decode([token_id]))

    async def record(self, served: Served, ctx: RequestContext) -> None:
        """Store the choices' confidences (for feedback) before the response goes out: group-committed in a thread, or
        on the event loop for a request alone (gateway/records/group_commit.py)."""
        rows = [(served.key(i), ctx.domain, a.calibration.confidence, a.served, ctx.caller.key_id)
                for i, a in enumerate(served.answers) if not a.calibration.escalated]  # escalated: handoff_store.py
        if rows:
            await self.shared.responses.add(rows)

    def capture(self, ctx: RequestContext, answer: str | None) -> None:
        if self.shared.capture is not None:
            kind = "multiple_choice" if ctx.prompt.multiple_choice else "free_form"
            self.shared.capture.add(ctx.domain, kind, ctx.request.question_text(),
                                    list(ctx.request.options or []) or None, answer)

    # -- respond ------------------------------------------------------------------------------------------------------
    async def complete(self, ctx: RequestContext):
        served = await self.answer(ctx)
        self.capture(ctx, served.answers[0].text)
        return ctx.view.response(served)

    async def answer(self, ctx: RequestContext) -> Served:
        served = self.calibrate(await ctx.scorer.score(ctx.job), ctx)
        handoff = self.shared.handoff
        served = await handoff.apply(served, ctx) if ctx.caller.handoff else handoff.withhold(served, ctx)
        await self.record(served, ctx)
        return served

    async def stream(self, ctx: RequestContext) -> AsyncIterator[str]:
        """SSE chunks in OpenAI's shape; each choice's calibration object arrives with its final chunk. Buffered answers
        come whole; free-form answers under an annotate policy stream token by token. Errors propagate: the router
        turns them into an SSE error event."""
        view, rid, n, base = ctx.view, ctx.response_id, ctx.job.request.n, ctx.numbering.first_index
        started: set[int] = set()  # choices whose first chunk went out
        self.capture(ctx, None)
        try:
            if view.chat:
                yield view.chunk(rid, [view.role_delta(i) for i in range(n)])
            if ctx.buffered:
                served = await self.answer(ctx)
                for i, answer in enumerate(served.answers):
                    yield view.chunk(rid, [view.delta(base + i, answer.text, answer.positions, first=True)])
                    yield view.chunk(rid, [view.finish(base + i, answer)])
            else:
                scoring = None
                async for item in ctx.scorer.stream(ctx.job):
                    if isinstance(item, Scoring):
                        scoring = item
                    elif item.text or item.token_ids:
                        yield self._token_chunk(ctx, item, started)
                if scoring is None:  # a scorer's stream ends with its Scoring (calm_core/scorers/base.py)
                    raise RuntimeError(f"{type(ctx.scorer).__name__}.stream ended without its scoring")
                served = self.calibrate(scoring, ctx)
                await self.record(served, ctx)
                for i, answer in enumerate(served.answers):
                    yield view.chunk(rid, [view.finish(base + i, answer)])
            if ctx.numbering.batched:
                ctx.usage = served.usage()
                return
            if ctx.request.stream_options is not None and ctx.request.stream_options.include_usage:
                yield view.chunk(rid, [], served.usage())
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            await self.engine.abort(ctx.job.request.request_id)
            raise

    def _token_chunk(self, ctx: RequestContext, delta: EngineDelta, started: set[int]) -> str:
        choice = ctx.view.delta(ctx.numbering.first_index + delta.index, delta.text, partial(self.positions, delta),
                                first=delta.index not in started)
        started.add(delta.index)
        return ctx.view.chunk(ctx.response_id, [choice])
