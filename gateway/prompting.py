"""Turning OpenAI requests into engine prompts, and deciding multiple-choice vs free-form mode."""

from __future__ import annotations

from dataclasses import dataclass

from calm_core.prompts import LETTERS, detect_option_letters, letter_user_message, render_chat
from gateway.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True)
class PreparedPrompt:
    text: str
    option_letters: tuple[str, ...] | None  # set in multiple-choice mode

    @property
    def multiple_choice(self) -> bool:
        return self.option_letters is not None


def prepare_chat(tokenizer, req: ChatCompletionRequest) -> PreparedPrompt:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    letters = None
    if req.options:
        # The request lists options: the last user message is the question, formatted like the training prompts.
        messages[last_user]["content"] = letter_user_message(messages[last_user]["content"], req.options)
        letters = LETTERS[: len(req.options)]
    else:
        letters = detect_option_letters(messages[last_user]["content"])
    return PreparedPrompt(render_chat(tokenizer, messages), letters)


def prepare_completion(req: CompletionRequest) -> PreparedPrompt:
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    if req.options:
        return PreparedPrompt(letter_user_message(prompt, req.options) + "\nAnswer: ", LETTERS[: len(req.options)])
    return PreparedPrompt(prompt, detect_option_letters(prompt))
