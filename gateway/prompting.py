"""Turning OpenAI requests into engine prompts, and deciding multiple-choice vs free-form mode.

A multiple-choice request (explicit `options`, or options written as "A. ..." lines in the prompt) is prompted the way
the served head was fitted: the letter format under the chat template, or, for cloze heads, the question alone as
`Question: ...\\nAnswer:` with each option's text scored after it. The cloze prompt is the last user message only
(system messages and earlier turns are not part of what the head was fitted on).
"""

from __future__ import annotations

from calm_core.prompts import (
    LETTERS, AnswerFormatName, PreparedPrompt, detect_option_letters, letter_user_message, options_prompt,
    parse_options_question, render_chat,
)
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest


def options_of(text: str, options: list[str] | None) -> tuple[str, tuple[str, ...]] | None:
    """(question, option texts) of a multiple-choice question: the request's `options`, or options written in the text."""
    return (text, tuple(options)) if options else parse_options_question(text)


def prepare_chat(tokenizer, req: ChatCompletionRequest, answer_format: AnswerFormatName = "letter") -> PreparedPrompt:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    if answer_format == "cloze" and (found := options_of(messages[last_user]["content"], req.options)):
        return options_prompt(tokenizer, *found, "cloze")
    letters = None
    if req.options:
        # The request lists options: the last user message is the question, formatted like the training prompts.
        messages[last_user]["content"] = letter_user_message(messages[last_user]["content"], req.options)
        letters = LETTERS[: len(req.options)]
    else:
        letters = detect_option_letters(messages[last_user]["content"])
    return PreparedPrompt(render_chat(tokenizer, messages), letters)


def prepare_completion(tokenizer, req: CompletionRequest, answer_format: AnswerFormatName = "letter") -> PreparedPrompt:
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    if answer_format == "cloze" and (found := options_of(prompt, req.options)):
        return options_prompt(tokenizer, *found, "cloze")
    if req.options:
        return PreparedPrompt(letter_user_message(prompt, req.options) + "\nAnswer: ", LETTERS[: len(req.options)])
    return PreparedPrompt(prompt, detect_option_letters(prompt))
