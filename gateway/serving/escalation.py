"""Escalation: the original request of an unsure answer goes to a stronger OpenAI-compatible model.

The target gets the caller's request as it came (messages or prompt, sampling parameters, log-prob asks), for as many
choices as were unsure. A multiple-choice question goes as lettered lines under protocol "openai", the letter in the
target's answer mapped back to an option; under protocol "calm" (the target is a CALM gateway) it keeps its options,
and the target's calibration comes back as the answer's confidence. A target that is down, slow past its timeout,
refuses, or answers without a usable text raises `TargetFailed`; the policy's `on_failure` then applies.

A request to a CALM target (protocol "calm") carries the signed hop of gateway/edge/peer.py when this gateway has the
fleet's peer secret: the target answers it without handing it off again, so two gateways pointing at each other (or
replicas sharing one policy table) cannot bounce a request between them. Other targets get no hop.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from calm_core.prompts import letter_user_message
from gateway.serving.logprobs import Position
from gateway.edge.peer import HOP_HEADER, hop_value
from gateway.policy.policies import EscalationTarget
from gateway.serving.prompting import options_of
from gateway.protocol.openai import ChatCompletionRequest, SamplingFields
from gateway.policy.targets import PRIVATE_EXTENSION, AddressRefused, GuardedTransport, Target, Targets

# Fields of the caller's request that belong to this gateway (routing, versions, options handled below, streaming:
# the target answers whole, the caller's stream is written from that answer).
_OWN_FIELDS = {"calm", "options", "stream", "stream_options", "model", "n"}


class TargetFailed(Exception):
    """The target gave no usable answer; `reason` is the metric label (timeout, connect, address, status, invalid,
    api_key, target).
    `detail` is for the gateway's log only: a caller is told `public` (the upstream's or transport's own text, or a
    secret's, never reaches a caller)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail

    @property
    def public(self) -> str:
        return _PUBLIC_REASONS.get(self.reason, "the target gave no usable answer")


_PUBLIC_REASONS = {"timeout": "the target did not answer in time", "connect": "the target could not be reached",
                   "status": "the target refused the request", "invalid": "the target's answer could not be used",
                   "api_key": "the target's API key is not available on this gateway",
                   "address": "the target's address is not one this gateway may call",
                   "target": "the target is not one the operator named"}


@dataclass(frozen=True)
class TargetAnswer:
    text: str
    finish_reason: str | None
    completion_tokens: int
    positions: list[Position] = field(default_factory=list)  # the target's log-probs, when the caller asked for them
    confidence: float | None = None  # a CALM target's calibrated confidence of this answer
    abstained: bool | None = None  # a CALM target withheld its own answer under its policy


def target_request(req: SamplingFields, model: str, protocol: str, n: int,
                   multiple_choice: bool) -> tuple[str, dict]:
    """The path under the target's base URL and the JSON body: the caller's request for `n` choices of `model` there.
    Multiple choice never asks for log-probs (the answer is a letter, not the target's tokens)."""
    chat = isinstance(req, ChatCompletionRequest)
    body = req.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=_OWN_FIELDS)
    body.update(model=model, n=n, stream=False)
    body.setdefault("temperature", 0.0)  # omitted, this gateway answers greedily (vLLM would sample at 1.0)
    if protocol == "openai":
        body.pop("metadata", None)  # the gateway's routing (domain); OpenAI's own API ties it to stored completions
    if multiple_choice:
        for name in ("logprobs", "top_logprobs", "echo"):
            body.pop(name, None)
    if req.options and protocol == "calm":
        body["options"] = list(req.options)
    elif req.options:
        lettered = letter_user_message(req.question_text(), req.options)
        if chat:
            last = max(i for i, m in enumerate(body["messages"]) if m["role"] == "user")
            body["messages"][last] = {**body["messages"][last], "content": lettered}
        else:
            body["prompt"] = lettered + "\nAnswer: "
    if protocol == "calm" and req.calm is not None:
        calm = req.calm.model_dump(exclude_none=True, exclude={"version"})  # a version names this gateway's registry
        if calm:
            body["calm"] = calm
    return ("/chat/completions" if chat else "/completions"), body


_LEADING_LETTER = re.compile(r"^\W*([A-M])(?:\s*$|[.):\]])")  # "B", "B.", "(B)"; not the article in "A whale"
_NAMED_LETTER = re.compile(r"\b(?:answer|option|choice)\b\W*(?:is\W*)?\(?([A-M])(?![A-Za-z])", re.IGNORECASE)
_ANY_LETTER = re.compile(r"(?<![A-Za-z])([A-M])(?![A-Za-z])")


def letter_of(text: str, letters: tuple[str, ...], options: tuple[str, ...] | None) -> str | None:
    """The option a free-text answer names: a leading letter ("B", "B) whale"), a named one ("the answer is C"), the
    one option whose text it contains, else the only option letter standing alone in it; None when it names none or
    several."""
    for pattern in (_LEADING_LETTER, _NAMED_LETTER):
        found = pattern.search(text)
        if found and found.group(1).upper() in letters:
            return found.group(1).upper()
    if options:
        lowered = text.lower()
        named = [letter for letter, option in zip(letters, options) if option.strip() and option.strip().lower() in lowered]
        if len(named) == 1:
            return named[0]
    alone = {m.group(1) for m in _ANY_LETTER.finditer(text)} & set(letters)
    return alone.pop() if len(alone) == 1 else None


def _positions(choice: dict, chat: bool) -> list[Position]:
    logprobs = choice.get("logprobs") or {}
    if chat:
        return [Position(p["token"], float(p["logprob"]),
                         tuple((t["token"], float(t["logprob"])) for t in p.get("top_logprobs") or []))
                for p in logprobs.get("content") or []]
    tops = logprobs.get("top_logprobs") or []
    return [Position(token, float(lp) if lp is not None else float("-inf"),
                     tuple((k, float(v)) for k, v in (tops[i] or {}).items()) if i < len(tops) else ())
            for i, (token, lp) in enumerate(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))]


def read_reply(payload: dict, n: int, chat: bool, letters: tuple[str, ...] | None,
               options: tuple[str, ...] | None) -> list[TargetAnswer]:
    """The target's `n` answers in index order, multiple-choice ones as the letter they name."""
    try:
        choices = sorted(payload["choices"], key=lambda c: c.get("index", 0))
        texts = [(c["message"]["content"] if chat else c["text"]) for c in choices]
        usage = int((payload.get("usage") or {}).get("completion_tokens") or 0)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise TargetFailed("invalid", "the target's response is not an OpenAI completion") from None
    if len(choices) < n or any(not isinstance(t, str) for t in texts[:n]):
        raise TargetFailed("invalid", f"the target sent {len(choices)} text answers for the {n} asked")
    shares = [usage // n + (1 if i < usage % n else 0) for i in range(n)]  # its usage is per response, not per choice
    answers = []
    for choice, text, tokens in zip(choices[:n], texts[:n], shares):
        calibration = choice.get("calibration") if isinstance(choice.get("calibration"), dict) else {}
        confidence = calibration.get("confidence")
        if letters is not None:
            letter = letter_of(text, letters, options)
            if letter is None:
                raise TargetFailed("invalid", f"the target's answer names none of the options {', '.join(letters)}")
            text, positions = letter, []
        else:
            positions = _positions(choice, chat)
        answers.append(TargetAnswer(text, choice.get("finish_reason"), tokens, positions,
                                    float(confidence) if isinstance(confidence, (int, float)) else None,
                                    calibration.get("abstained") if calibration else None))
    return answers


def api_key(target: Target) -> str | None:
    """The target's key, read at call time (rotated keys apply at once; the operator's settings hold its source)."""
    if target.api_key_env:
        value = os.environ.get(target.api_key_env)
        if not value:
            raise TargetFailed("api_key", f"the environment variable {target.api_key_env} is not set on this gateway")
        return value
    if target.api_key_file:
        try:
            value = Path(target.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise TargetFailed("api_key", f"cannot read the API key file: {getattr(e, 'strerror', None) or 'not text'}"
                               ) from None
        # A key is one token: a file of several lines or spaces is not a key file, and its content is never sent.
        if not value or any(c.isspace() for c in value) or not value.isprintable():
            raise TargetFailed("api_key", f"{target.api_key_file} does not hold one API key (one line, no spaces)")
        return value
    return None


def operator_target(targets: Targets, name: str | None, legacy_url: str | None, kind: str = "escalate") -> Target:
    """The operator's target of `kind` a policy names (TargetFailed when the operator lists none by that name or
    URL)."""
    found = targets.find(name, legacy_url, kind)
    if found is None:
        named = name or f"the URL {legacy_url} (a policy stored before targets were named)"
        raise TargetFailed("target", f"{named} is not one of the operator's {kind} targets (CALM_TARGETS)")
    return found


def call_headers(target: Target) -> dict[str, str]:
    key = api_key(target)
    return {"Authorization": f"Bearer {key}"} if key else {}


class Escalator:
    """Calls the operator's targets over one pooled HTTP client (opened on first use, closed with the gateway), through
    the transport that refuses addresses a target may not reach."""

    def __init__(self, peer_secret: str | None = None, targets: Targets | None = None):
        self._client: httpx.AsyncClient | None = None
        self.peer_secret, self.targets = peer_secret, targets or Targets()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(transport=GuardedTransport())  # its pools: 256 connections each
        return self._client

    async def post(self, target: Target, url: str, timeout_s: float, **kwargs) -> httpx.Response:
        """One call to an operator's target, its address checked, given up after `timeout_s` whatever it does."""
        async with asyncio.timeout(timeout_s):
            return await self.client.post(url, timeout=timeout_s, extensions={PRIVATE_EXTENSION: target.private},
                                          **kwargs)

    async def ask(self, policy: EscalationTarget, req: SamplingFields, n: int,
                  letters: tuple[str, ...] | None) -> list[TargetAnswer]:
        """The target's answers, or TargetFailed once `policy.timeout_s` has passed, whatever the target does."""
        target = operator_target(self.targets, policy.target, policy.legacy_url)
        path, body = target_request(req, policy.model, target.protocol, n, letters is not None)
        content = json.dumps(body).encode()  # the exact bytes the hop signs
        headers = {"Content-Type": "application/json", **call_headers(target)}
        if target.protocol == "calm" and self.peer_secret:
            headers[HOP_HEADER] = hop_value(self.peer_secret, content)
        try:
            response = await self.post(target, target.url.rstrip("/") + path, policy.timeout_s, content=content,
                                       headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            raise TargetFailed("timeout", f"no answer within {policy.timeout_s:g} s") from None
        except AddressRefused as e:
            raise TargetFailed("address", str(e)) from None
        except httpx.HTTPError as e:
            raise TargetFailed("connect", f"{type(e).__name__}: {e}") from None
        if response.status_code != 200:
            raise TargetFailed("status", f"HTTP {response.status_code}: {response.text[:200]}")
        try:
            payload = response.json()
        except ValueError:
            raise TargetFailed("invalid", "the target's response is not JSON") from None
        mc = options_of(req.question_text(), req.options) if letters is not None else None
        return read_reply(payload, n, isinstance(req, ChatCompletionRequest), letters, mc[1] if mc else None)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
