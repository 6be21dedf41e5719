"""The first step of the request path: an OpenAI request checked and turned into the engine request its scorer
starts from (sampling parameters, limits, which of the artifact's weights and head serve it)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from calm_core.artifact import LoadedArtifact
from calm_core.engine import EngineClient, EngineRequest
from calm_core.prompts import AnswerFormat, PreparedPrompt
from calm_core.scorers.base import PostHoc
from gateway.errors import APIError
from gateway.protocol.openai import SamplingFields
from gateway.settings import GatewaySettings


@dataclass(frozen=True)
class ServedArtifact:
    """What the gateway needs to know about the served artifact to route a request through it."""

    answer_format: AnswerFormat = AnswerFormat.LETTER  # how its head was fitted to multiple choice
    multiple_choice_only: bool = False  # fitted to multiple choice: free-form answers need a free-form mode
    has_adapter: bool = False
    free_form_version: str | None = None  # the free-form mode inside the artifact (its own weights and head)
    post_hoc: PostHoc = PostHoc()  # option temperature (recalibrated versions), the free-form mode's semantic map

    @classmethod
    def of(cls, artifact: LoadedArtifact) -> "ServedArtifact":
        manifest = artifact.manifest
        on_disk = "path" in artifact.__dict__  # unit tests build bare artifacts, with a manifest only
        free_form = artifact.free_form if on_disk else None
        post_hoc = PostHoc(manifest.option_temperature, free_form.manifest.semantic if free_form is not None else None,
                           free_form.manifest.token_temperature if free_form is not None else 1.0,
                           (free_form or artifact).head.keeps_order if on_disk else False)
        return cls(manifest.answer_format, manifest.applies_to == "multiple_choice", manifest.has_adapter,
                   manifest.free_form_version, post_hoc)


def prompt_token_bound(text: str) -> int:
    """At least as many as the prompt's tokens, without tokenizing: a token of a byte-level BPE covers at least one
    byte, and a SentencePiece tokenizer adds at most one (its dummy prefix). Tokenizing costs more than the rest of
    preparing a short free-form request, and most prompts are far from the context limit."""
    return len(text.encode()) + 1


class RequestPlanner:
    """Turns a checked OpenAI request and its prepared prompt into the template engine request."""

    def __init__(self, settings: GatewaySettings, engine: EngineClient, tokenizer, artifact: ServedArtifact):
        self.settings, self.engine, self.tokenizer, self.artifact = settings, engine, tokenizer, artifact
        # Free-form answers from the artifact's free-form mode where the engine serves it; else, for an artifact fitted
        # to multiple choice only, from the base weights without a head.
        self.free_form_mode = artifact.free_form_version is not None and getattr(engine, "free_form_mode", False)

    def template(self, req: SamplingFields, prompt: PreparedPrompt, max_tokens: int, top_logprobs: int) -> EngineRequest:
        if not prompt.multiple_choice:
            self.check_free_form_served()
        self._check_limits(req, prompt, max_tokens)
        # The artifact's weights and head serve the answers they were fitted for.
        free_form = not prompt.multiple_choice and self.free_form_mode
        fitted = prompt.multiple_choice or not self.artifact.multiple_choice_only
        common = dict(request_id=os.urandom(16).hex(), prompt=prompt.text, temperature=req.temperature or 0.0,
                      top_p=req.top_p or 1.0, seed=req.seed, calibrated=fitted or free_form,
                      adapter=fitted and self.artifact.has_adapter and not free_form, free_form=free_form, n=req.n)
        if prompt.multiple_choice:
            return EngineRequest(**common, max_tokens=1)  # the scorer says what to read from it
        return EngineRequest(**common, max_tokens=max_tokens, stop=req.stop_list(),
                             top_logprobs=max(top_logprobs, self.settings.default_top_logprobs), **self._shaping(req))

    def check_free_form_served(self, param: str = "options", ask: str = "send `options`") -> None:
        """A 400 for a free-form answer where the gateway serves multiple choice only: no engine would answer it (the
        in-process engines for free form are not started), which would otherwise be a 503 or, for an artifact without
        a free-form mode, an answer from weights nobody meant to serve."""
        if not self.settings.free_form_answers:
            raise APIError(400, f"this gateway serves multiple-choice answers only (CALM_ANSWERS=multiple_choice): {ask}",
                           param=param, code="free_form_not_served")

    def _check_limits(self, req: SamplingFields, prompt: PreparedPrompt, max_tokens: int) -> None:
        if max_tokens > self.settings.max_tokens_limit:
            named = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"{named} {max_tokens} exceeds this gateway's limit of {self.settings.max_tokens_limit}",
                           param=named, code="max_tokens_exceeded")
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

    def _shaping(self, req: SamplingFields) -> dict:
        """Free-form sampling parameters for the engine, checked where the engine's own error would not name them."""
        if req.n > 1 and not req.temperature:  # vLLM's own refusal would blame "greedy sampling" nobody asked for
            raise APIError(400, f"n={req.n} asks for several sampled answers: set a temperature above 0 (omitted, this "
                           "gateway answers greedily)", param="n")
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
