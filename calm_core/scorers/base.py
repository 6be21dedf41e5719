"""What every scorer shares: the job it is given, the scoring it returns, and the interface.

A scorer is one way of turning a prepared question into calibrated numbers: it plans the engine requests it needs
(from a template request that carries the caller's sampling parameters and which weights to use), sends them through
an `EngineClient`, and reads the outputs into one `ScoredChoice` per requested choice. It knows nothing of HTTP,
policies or storage: the gateway applies a policy to the scoring and records it; offline evaluation compares it with
labels. Both therefore score "as served" by the same code.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from enum import Enum
from typing import ClassVar, Protocol

from calm_core.engine import EngineDelta, EngineOutput, EngineRequest
from calm_core.prompts import PreparedPrompt
from calm_core.semantic import SemanticCalibration


class AnswerKind(str, Enum):
    MULTIPLE_CHOICE = "multiple_choice"
    FREE_FORM = "free_form"


class ConfidenceMethod(str, Enum):
    """How a free-form answer's confidence is measured (a request's or policy's `confidence`)."""

    TOKEN = "token"
    SEMANTIC = "semantic"


class ScoringPath(str, Enum):
    """Every registered scorer, by name (shown in /health and in reports)."""

    LETTER = "letter"
    CLOZE_PER_TOKEN = "cloze_per_token"
    CLOZE_ONE_PASS = "cloze_one_pass"
    TOKEN = "token"
    SEMANTIC = "semantic"


@dataclass(frozen=True)
class PostHoc:
    """What a version applies to its numbers after the α head: a temperature on multiple-choice option scores and one
    on its free-form mode's token confidence (labelled recalibration, calm_core/recalibration.py), and that mode's
    semantic-confidence map."""

    option_temperature: float = 1.0
    semantic: SemanticCalibration | None = None
    token_temperature: float = 1.0  # free-form token confidence c served as c ** (1 / T) (labelled recalibration)
    # The free-form head is one scale and one shift for every token (a temperature): it keeps the model's order of
    # tokens, so a greedy draw through it is the model's own greedy answer (calm_core/scorers/free_form.py).
    head_keeps_order: bool = False


@dataclass(frozen=True)
class ScoringJob:
    """One question to score: its prompt, the template request (sampling parameters, n, which weights), whether the
    raw model's confidence is wanted too, and how many answers to sample where the method samples."""

    prompt: PreparedPrompt
    request: EngineRequest
    with_raw: bool = False
    samples: int = 0


@dataclass
class ScoredChoice:
    """One choice's answer and its calibration numbers, whatever the answer kind."""

    text: str
    finish_reason: str | None
    confidence: float
    raw_confidence: float | None
    entropy: float
    completion_tokens: int
    option_probs: tuple[float, ...] | None = None  # multiple choice: the options' calibrated distribution
    chosen: int | None = None  # multiple choice: the chosen option's index
    clusters: list[tuple[str, int]] | None = None  # semantic: each cluster's representative answer and size
    output: EngineOutput | None = None  # free form: the engine's output (token log-probs for the wire)
    # free form: each answer token's log-prob read back under the version's calibration (temperature 1, untruncated)
    calibrated_logprobs: list[float] | None = None


@dataclass
class Scoring:
    """All choices of one question, the prompt's token count, and the scorer that produced them."""

    path: ScoringPath
    kind: AnswerKind
    choices: list[ScoredChoice]
    prompt_tokens: int

    @property
    def method(self) -> ConfidenceMethod | None:
        return ConfidenceMethod(self.path.value) if self.kind is AnswerKind.FREE_FORM else None


class Scorer(Protocol):
    path: ClassVar[ScoringPath]
    kind: ClassVar[AnswerKind]
    description: ClassVar[str]  # how it scores, one line (for /health)
    streams: ClassVar[bool]  # its answer can be shown token by token before the confidence is known

    async def score(self, job: ScoringJob) -> Scoring: ...

    def stream(self, job: ScoringJob) -> AsyncIterator[EngineDelta | Scoring]:
        """The answer as the engine writes it (its deltas), then its Scoring, last: the scorer makes every engine call
        of a streamed answer too. One whose answer comes whole (`streams` False) yields the Scoring alone."""
        ...


class WholeAnswer:
    """The stream of a scorer whose answer is known only with its confidence: its scoring, once."""

    streams: ClassVar[bool] = False

    async def stream(self, job: ScoringJob) -> AsyncIterator[EngineDelta | Scoring]:
        yield await self.score(job)  # type: ignore[attr-defined]  # the scorer's own


def raw_request(request: EngineRequest, **changes) -> EngineRequest:
    """The same request for the raw model's numbers: α head skipped, its own request id."""
    return replace(request, request_id=request.request_id + "-raw", calibrated=False, **changes)
