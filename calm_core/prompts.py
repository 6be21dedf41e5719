"""Prompt builders under the model's chat template: the letter format ("answer with a single letter") and the cloze
format (the question alone; each option is scored as the text of the answer)."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from calm_core.data import MAX_OPTIONS, MIN_OPTIONS, MCQuestion
from calm_core.errors import ModelError

LETTERS = tuple(string.ascii_uppercase[:MAX_OPTIONS])  # A..M


class AnswerFormat(StrEnum):
    """How an answer is scored, and so how an artifact's head was fitted (its manifest's `answer_format`): multiple
    choice by the answer letter after the chat-templated question, or by each option's text (cloze); free-form answers
    by their generated tokens after the chat-templated question (generative; multiple choice then falls back to the
    letter format). A StrEnum: it compares, hashes, prints and serialises as its value."""

    LETTER = "letter"
    CLOZE = "cloze"
    GENERATIVE = "generative"


INSTRUCTION = "Answer the following multiple-choice question with a single letter."


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation, tokenize: bool = ..., add_generation_prompt: bool = ...): ...


def option_letters(n_options: int) -> tuple[str, ...]:
    if not MIN_OPTIONS <= n_options <= MAX_OPTIONS:
        raise ValueError(f"Expected between {MIN_OPTIONS} and {MAX_OPTIONS} options, but got {n_options}")
    return LETTERS[:n_options]


def letter_user_message(question: str, choices: Sequence[str]) -> str:
    letters = option_letters(len(choices))
    lines = [INSTRUCTION, "", question.strip(), ""]
    lines += [f"{letter}. {choice.strip()}" for letter, choice in zip(letters, choices)]
    lines += ["", f"Answer with one letter ({', '.join(letters)})."]
    return "\n".join(lines)


def letter_messages(q: MCQuestion) -> list[dict[str, str]]:
    return [{"role": "user", "content": letter_user_message(q.question, q.choices)}]


def render_chat(tokenizer: ChatTokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text the model continues: chat template plus the assistant's generation prompt."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def letter_prompt(tokenizer: ChatTokenizer, q: MCQuestion) -> str:
    return render_chat(tokenizer, letter_messages(q))


def cloze_prompt(question: str) -> str:
    """The question alone; each option is scored as the text that follows (`cloze_option`).

    Plain text, not the chat template: zero-shot on 200 questions each, SmolLM2-135M-Instruct chose better this way on
    average (0.33 vs 0.30 over ARC-Easy, ARC-Challenge, OpenBookQA, CommonsenseQA; better on ARC-Easy and OpenBookQA,
    worse on ARC-Challenge; benchmarks/scoring/cloze_formats.py)."""
    return f"Question: {question.strip()}\nAnswer:"


def cloze_option(choice: str) -> str:
    return " " + choice.strip()


@dataclass(frozen=True)
class ClozeTokens:
    """Token ids of a cloze question: the prompt, and each option's text as it follows the prompt."""

    prompt: tuple[int, ...]
    options: tuple[tuple[int, ...], ...]


def cloze_tokens(tokenizer, question: str, choices: Sequence[str]) -> ClozeTokens:
    """Prompt and options tokenized apart, without special tokens: training and serving score exactly these ids."""
    encode = lambda text: tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    options = tuple(encode(cloze_option(c)) for c in choices)
    for k, tokens in enumerate(options):
        if not tokens:
            raise ModelError(f"option {k} has no tokens")
    return ClozeTokens(encode(cloze_prompt(question)), options)


@dataclass(frozen=True)
class PreparedPrompt:
    """A question ready for a scorer: the prompt text the engine continues, the option letters in multiple-choice mode,
    and the cloze token ids when the options are scored by their text."""

    text: str
    option_letters: tuple[str, ...] | None  # set in multiple-choice mode
    cloze: ClozeTokens | None = None  # set when the options are scored by cloze

    @property
    def multiple_choice(self) -> bool:
        return self.option_letters is not None


def options_prompt(tokenizer, question: str, choices: Sequence[str], answer_format: AnswerFormat) -> PreparedPrompt:
    """A multiple-choice question as the artifact's head was fitted: the letter format under the chat template, or the
    cloze prompt with each option's tokens (the gateway's explicit `options` and offline evaluation both use this)."""
    if answer_format == "cloze":
        return PreparedPrompt(cloze_prompt(question), LETTERS[: len(choices)], cloze_tokens(tokenizer, question, choices))
    message = {"role": "user", "content": letter_user_message(question, choices)}
    return PreparedPrompt(render_chat(tokenizer, [message]), LETTERS[: len(choices)])


def letter_token_ids(tokenizer) -> list[int]:
    """Token id of each letter A..M as the model emits it right after the assistant prompt."""
    ids = []
    for letter in LETTERS:
        toks = tokenizer.encode(letter, add_special_tokens=False)
        if len(toks) != 1:
            raise ModelError(f"tokenizer splits the answer letter {letter!r} into {len(toks)} tokens")
        ids.append(int(toks[0]))
    return ids


_OPTION_LINE = re.compile(r"^\s*\(?([A-M])[.):]\s+\S", re.MULTILINE)


def _option_run(text: str) -> list[re.Match]:
    """The option lines of the last complete run A, B, C, ... in the text (no gaps, at least two), else []."""
    found: list[re.Match] = []
    for match in _OPTION_LINE.finditer(text):
        letter = match.group(1)
        if len(found) < len(LETTERS) and letter == LETTERS[len(found)]:
            found.append(match)
        elif letter == "A":
            found = [match]  # a later list restarts: the last complete run wins
    return found if len(found) >= MIN_OPTIONS else []


def detect_option_letters(text: str) -> tuple[str, ...] | None:
    """Letters of an options question written in the text ("A. ...", "B) ...", "(C) ..."), if it is one.

    The letters must run A, B, C, ... without gaps, at least two of them; otherwise the text is not treated as a
    multiple-choice question.
    """
    run = _option_run(text)
    return tuple(m.group(1) for m in run) or None


def parse_options_question(text: str) -> tuple[str, tuple[str, ...]] | None:
    """(question, option texts) of an options question written in the text, as `detect_option_letters` finds it.

    The question is the text before the first option line (without this project's own letter instruction); each
    option is the rest of its line, so an instruction after the options ("Answer with a letter.") is not part of one.
    """
    run = _option_run(text)
    if not run:
        return None
    question = text[: run[0].start()].strip()
    if question.startswith(INSTRUCTION):
        question = question[len(INSTRUCTION):].strip()
    # Each match ends on the option's first non-space character.
    choices = tuple(text[m.end() - 1 :].split("\n", 1)[0].strip() for m in run)
    return question, choices
