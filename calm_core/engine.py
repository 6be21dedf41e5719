"""The engine seam: the request/output types and the client protocol that scorers (calm_core/scorers/), the gateway and
offline evaluation all speak, whatever runs the model (in-process vLLM, an upstream vLLM server, HF offline).

Requests carry a rendered prompt (the gateway applies the chat template) or its token ids, and what to return: the
log-probs of given tokens at the first position (multiple choice: answer letters, or the next token of an option's text
when options are scored by cloze) or the top-k log-probs of each generated token (free form).
All log-probs are the engine's calibrated ones (α head applied inside vLLM).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class EngineUnavailable(Exception):
    """The engine cannot serve now (dead upstream, timeout, shut down): the gateway answers 503."""


class EngineRejected(Exception):
    """The engine refused the request as invalid (e.g. prompt too long): the gateway answers 400."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: str
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # top-k calibrated log-probs per generated token (free form)
    option_token_ids: tuple[int, ...] = ()  # return these tokens' log-probs at the first position
    restrict_to_options: bool = True  # ... and sample only among them (letter answers); False when scoring a continuation
    calibrated: bool = True  # False: the raw model's numbers (α head skipped for this request)
    prompt_token_ids: tuple[int, ...] = ()  # when set, the prompt as token ids (then `prompt` is not tokenized)
    adapter: bool = False  # run with the artifact's LoRA adapter (engines serving one); else the base weights
    folded: bool = False  # run on the weights with the α head folded into the LM head (engines with `folded_scoring`)
    prompt_logprobs: bool = False  # also return the log-prob of every prompt token (taken before logits processors)
    # With prompt_logprobs: read the engine's prefix cache anyway. The prompt's cached blocks are not recomputed, so
    # their positions come back as NaN; only the tokens after them get log-probs (engines with `prefix_reuse`).
    reuse_prefix: bool = False
    # With prompt_logprobs: the first prompt position the caller reads. An engine may leave the positions before it NaN
    # (vLLM returns them all; the offline engine runs its LM head only from there: most of a cloze prompt is the
    # question, whose log-probs no scorer reads, and its LM head is a third of a packed question's cost).
    prompt_logprobs_from: int = 0
    free_form: bool = False  # run on the artifact's free-form mode: its weights and its α head (`free_form_mode`)
    # OpenAI / vLLM sampling parameters, passed to the engine unchanged (defaults: vLLM's "off" values).
    n: int = 1  # completions from one prompt; vLLM gives child i the seed `seed + i`
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: str | None = None  # structured output: the answer must match this JSON schema (JSON text)
    json_object: bool = False  # structured output: the answer must be a JSON object


@dataclass
class EngineDelta:
    """A piece of output: new text, and per new token its id, calibrated log-prob and top/option log-probs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    index: int = 0  # which of the request's n completions this piece belongs to
    prompt_logprobs: list[float] | None = None  # per prompt token (the first has none: nan), when asked for
    # The prompt's token ids as the engine tokenized it (its first piece; engines that report them): what an answer's
    # read-back must continue, special tokens included.
    prompt_token_ids: list[int] | None = None


@dataclass
class EngineOutput:
    text: str
    token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None
    prompt_tokens: int
    prompt_logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None

    @classmethod
    def collect(cls, deltas: list[EngineDelta]) -> "EngineOutput":
        out = cls("", [], [], [], None, 0)
        for d in deltas:
            out.prompt_logprobs = d.prompt_logprobs if d.prompt_logprobs is not None else out.prompt_logprobs
            out.prompt_token_ids = d.prompt_token_ids if d.prompt_token_ids is not None else out.prompt_token_ids
            out.text += d.text
            out.token_ids += d.token_ids
            out.token_logprobs += d.token_logprobs
            out.top_logprobs += d.top_logprobs
            out.finish_reason = d.finish_reason or out.finish_reason
            out.prompt_tokens = d.prompt_tokens if d.prompt_tokens is not None else out.prompt_tokens
        return out

    @classmethod
    def collect_choices(cls, deltas: list[EngineDelta], n: int) -> list["EngineOutput"]:
        """One output per completion index; the prompt's token count (reported once) goes to every one."""
        outs = [cls.collect([d for d in deltas if d.index == i]) for i in range(n)]
        prompt_tokens = max((o.prompt_tokens for o in outs), default=0)
        for out in outs:
            out.prompt_tokens = prompt_tokens
        return outs


@runtime_checkable
class EngineClient(Protocol):
    model_name: str
    artifact_version: str
    max_model_len: int
    folded_scoring: bool  # serves `folded` requests: the α head folded into the weights (one-pass option scoring)
    # Optional: `prefix_reuse` (honours `reuse_prefix`) and `prefix_block` (tokens per cache block), in-process vLLM;
    # `async generate_whole(request) -> list[EngineDelta]`: the whole output at once, cheaper than its stream (upstream);
    # `dead() -> str | None`: why the engine can never serve again (an in-process engine core that died), else None.
    free_form_mode: bool  # serves `free_form` requests: the artifact's free-form weights and head
    prompt_logprobs: bool  # answers `prompt_logprobs` requests (raw free-form confidence needs them)

    async def start(self) -> None: ...

    def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raise EngineUnavailable when the engine cannot serve."""

    async def close(self) -> None: ...

    def describe(self) -> dict:
        """What serves requests and with which settings in force (for /health)."""


class EngineFactory(Protocol):
    """Starts an engine serving an artifact: its weights (its LoRA adapter merged into `base_model`, if it has one) and
    its α head; the engine is closed when the context ends. Offline evaluation takes one from the caller (the CLI
    passes vLLM in process), so training scores free-form answers as served without importing an engine."""

    def __call__(self, base_model: str, artifact_dir: str) -> AbstractAsyncContextManager[EngineClient]: ...


class EngineWorkExceeded(Exception):
    """One client request would start more engine sequences than its budget allows."""


class EngineBudget:
    """How many engine sequences (a request's `n` each) one client request may start: per-token option scoring,
    semantic samples, read-backs and several prompts multiply one request into many, and without a bound one call could
    queue tens of thousands of engine requests. The gateway sets one per client request (`engine_budget`); the asyncio
    tasks a scorer fans out to share it, as they share the context they were created in."""

    def __init__(self, limit: int):
        self.limit, self.spent = limit, 0

    def spend(self, sequences: int) -> None:
        if self.spent + sequences > self.limit:
            raise EngineWorkExceeded(f"this request needs more than {self.limit} engine sequences (options x option "
                                     "tokens, samples, n and prompts multiply): ask for fewer")
        self.spent += sequences


engine_budget: ContextVar[EngineBudget | None] = ContextVar("engine_budget", default=None)
_prepaid: ContextVar[bool] = ContextVar("engine_prepaid", default=False)


def charged(request: EngineRequest) -> EngineRequest:
    """The request, counted against the client request's engine budget (none set: offline work, uncounted; inside a
    `prepaid` fan-out: counted already)."""
    budget = engine_budget.get()
    if budget is not None and not _prepaid.get():
        budget.spend(request.n)
    return request


@contextmanager
def prepaid(requests: Iterable[EngineRequest]) -> Iterator[None]:
    """A fan-out charged as a whole before any of it starts: over budget, none of its engine requests is sent (charged
    one by one as tasks start, those started before the one refused would run on with nobody waiting for them). The
    tasks created inside inherit the mark and are not charged again."""
    budget = engine_budget.get()
    if budget is not None and not _prepaid.get():
        budget.spend(sum(r.n for r in requests))
    token = _prepaid.set(True)
    try:
        yield
    finally:
        _prepaid.reset(token)


async def whole_answer(engine: EngineClient, request: EngineRequest) -> list[EngineDelta]:
    """Every piece of a request's output, asked for whole where the engine offers it (`generate_whole`: an upstream
    server formats one response instead of one per token), else collected from its stream."""
    charged(request)
    whole = getattr(engine, "generate_whole", None)
    if whole is not None:
        return await whole(request)
    return [d async for d in engine.stream(request)]


async def generate(engine: EngineClient, request: EngineRequest) -> EngineOutput:
    return EngineOutput.collect(await whole_answer(engine, request))


async def generate_choices(engine: EngineClient, request: EngineRequest) -> list[EngineOutput]:
    """All n completions of a request, in index order."""
    return EngineOutput.collect_choices(await whole_answer(engine, request), request.n)
