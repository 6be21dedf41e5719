"""Turning OpenAI requests into engine prompts, and deciding multiple-choice vs free-form mode.

A multiple-choice request (explicit `options`, or options written as "A. ..." lines in the prompt) is prompted the way
the served head was fitted: the letter format under the chat template, or, for cloze heads, the question alone as
`Question: ...\\nAnswer:` with each option's text scored after it. The cloze prompt is the last user message only
(system messages and earlier turns are not part of what the head was fitted on).
"""

from __future__ import annotations

from functools import lru_cache

from calm_core.prompts import (
    LETTERS, AnswerFormat, PreparedPrompt, detect_option_letters, letter_user_message, options_prompt,
    parse_options_question, render_chat,
)
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest


def options_of(text: str, options: list[str] | None) -> tuple[str, tuple[str, ...]] | None:
    """(question, option texts) of a multiple-choice question: the request's `options`, or options written in the text."""
    return (text, tuple(options)) if options else parse_options_question(text)


def prepare_chat(tokenizer, req: ChatCompletionRequest, answer_format: AnswerFormat = AnswerFormat.LETTER) -> PreparedPrompt:
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    if answer_format == AnswerFormat.CLOZE and (found := options_of(messages[last_user]["content"], req.options)):
        return options_prompt(tokenizer, *found, "cloze")
    letters = None
    if req.options:
        # The request lists options: the last user message is the question, formatted like the training prompts.
        messages[last_user]["content"] = letter_user_message(messages[last_user]["content"], req.options)
        letters = LETTERS[: len(req.options)]
    else:
        letters = detect_option_letters(messages[last_user]["content"])
    return PreparedPrompt(rendered(tokenizer, messages), letters)


CACHED_CHARS = 4096  # conversations up to this many characters are kept: at most 2048 x 4 KB of keys and prompts


def rendered(tokenizer, messages: list[dict[str, str]]) -> str:
    if sum(len(m["content"]) for m in messages) > CACHED_CHARS:
        return render_chat(tokenizer, messages)
    return _rendered(tokenizer, tuple((m["role"], m["content"]) for m in messages))


@lru_cache(maxsize=2048)
def _rendered(tokenizer, messages: tuple[tuple[str, str], ...]) -> str:
    """The chat template's text for these messages, rendered once while they keep coming (a sandboxed Jinja render
    was the largest share of the gateway's own work per short request, benchmarks/gateway/bench_lean.py --profile): repeated
    conversations (a fixed system prompt and question, retries, evaluation runs, probes) skip it. Bounded: at most
    2048 short conversations are kept, the least recently used dropped first."""
    return render_chat(tokenizer, [{"role": role, "content": content} for role, content in messages])


def prepare_completion(tokenizer, req: CompletionRequest, answer_format: AnswerFormat = AnswerFormat.LETTER) -> PreparedPrompt:
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
    if answer_format == AnswerFormat.CLOZE and (found := options_of(prompt, req.options)):
        return options_prompt(tokenizer, *found, "cloze")
    if req.options:
        return PreparedPrompt(letter_user_message(prompt, req.options) + "\nAnswer: ", LETTERS[: len(req.options)])
    return PreparedPrompt(prompt, detect_option_letters(prompt))
