"""The registry of scorers, and which one scores a request.

Multiple choice is scored the way the artifact's head was fitted (its answer format; cloze in one pass where the
engine serves folded weights); free form by the confidence method the request or the domain's policy asks for.
Adding a scorer: a class built from (engine, tokenizer, post_hoc) with `path`, `kind`, `description`, `streams` and
`score` (calm_core/scorers/base.py), a `ScoringPath` member, an entry in `SCORERS`, and, for a new confidence method,
a `ConfidenceMethod` member.
"""

from __future__ import annotations

from calm_core.engine import EngineClient
from calm_core.prompts import AnswerFormat, PreparedPrompt
from calm_core.scorers.base import ConfidenceMethod, PostHoc, Scorer, ScoringPath
from calm_core.scorers.free_form import SemanticScorer, TokenScorer
from calm_core.scorers.options import ClozeOnePassScorer, ClozePerTokenScorer, LetterScorer

SCORERS: dict[ScoringPath, type] = {
    ScoringPath.LETTER: LetterScorer,
    ScoringPath.CLOZE_PER_TOKEN: ClozePerTokenScorer,
    ScoringPath.CLOZE_ONE_PASS: ClozeOnePassScorer,
    ScoringPath.TOKEN: TokenScorer,
    ScoringPath.SEMANTIC: SemanticScorer,
}
FREE_FORM_PATHS = {ConfidenceMethod.TOKEN: ScoringPath.TOKEN, ConfidenceMethod.SEMANTIC: ScoringPath.SEMANTIC}


def multiple_choice_path(answer_format: AnswerFormat, folded_scoring: bool) -> ScoringPath:
    if answer_format is AnswerFormat.CLOZE:
        return ScoringPath.CLOZE_ONE_PASS if folded_scoring else ScoringPath.CLOZE_PER_TOKEN
    return ScoringPath.LETTER


class Scorers:
    """The scorers of one engine, for one artifact's answer format."""

    def __init__(self, engine: EngineClient, tokenizer, answer_format: AnswerFormat | str,
                 post_hoc: PostHoc = PostHoc()):
        self.answer_format = AnswerFormat(answer_format)
        self.multiple_choice = multiple_choice_path(self.answer_format, getattr(engine, "folded_scoring", False))
        self._built = {path: cls(engine, tokenizer, post_hoc) for path, cls in SCORERS.items()}

    def __getitem__(self, path: ScoringPath) -> Scorer:
        return self._built[path]

    def for_prompt(self, prompt: PreparedPrompt, method: ConfidenceMethod = ConfidenceMethod.TOKEN) -> Scorer:
        return self._built[self.multiple_choice if prompt.multiple_choice else FREE_FORM_PATHS[method]]
