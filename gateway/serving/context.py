"""What one request carries through the request path, from the router to the record (its own module, so that every
part of the path may name it without importing the service)."""

from __future__ import annotations

from dataclasses import dataclass

from calm_core.prompts import PreparedPrompt
from calm_core.scorers.base import Scorer, ScoringJob
from gateway.policy.policies import ResolvedPolicy
from gateway.protocol.openai import SamplingFields, UsageInfo
from gateway.serving.wire import WireView


@dataclass(frozen=True)
class Caller:
    """Who asks, as the edge established it before the context is built."""

    key_id: str | None = None  # the client key asking: its answers take feedback from it (or a labeller key) only
    # False for a request another gateway escalated here (a signed hop): it is answered, never handed off again.
    handoff: bool = True
    # False for a request pinned (`calm.version`) to a version other than the one serving its domain: its answers
    # count in the domain's metrics but not in its drift window, which measures the serving version against its own
    # reference.
    drift: bool = True


@dataclass(frozen=True)
class Numbering:
    """Where one prompt of several (completions, gateway/serving/batch.py) sits in their response: its choices are
    numbered from `first_index` under the response id they share, and its stream leaves the usage and [DONE] to the
    response. The default: a request of its own."""

    response_id: str | None = None  # None: the prompt's own
    first_index: int = 0
    batched: bool = False


@dataclass
class RequestContext:
    """Everything one request carries through the path."""

    request: SamplingFields
    domain: str
    prompt: PreparedPrompt
    scorer: Scorer
    job: ScoringJob
    policy: ResolvedPolicy
    view: WireView
    response_id: str
    caller: Caller
    numbering: Numbering
    usage: UsageInfo | None = None  # a batched prompt's share, set when its stream ends

    @property
    def buffered(self) -> bool:
        """The whole answer is needed before any text may be shown: multiple choice, sampled confidences, and every
        action that may withhold it (abstain, escalate, review)."""
        return not self.scorer.streams or self.policy.action.withholds
