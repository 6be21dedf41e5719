"""Prompt builders: the letter format ("answer with a single letter") under the model's chat template."""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Protocol

from calm_core.data import MAX_OPTIONS, MIN_OPTIONS, MCQuestion

LETTERS = tuple(string.ascii_uppercase[:MAX_OPTIONS])  # A..M

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
