"""Several prompts in one completions request (`prompt` a list, as vLLM's server takes it).

Each prompt is answered exactly as its own request would be (its scorer, policy, record and capture), concurrently;
the response has one id, and prompt i's answer j is choice i * n + j, vLLM's numbering, which is also the
`choice_index` feedback names. A stream interleaves the prompts' chunks as they come and ends with one usage chunk
(when asked) and one [DONE].
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.serving.context import Caller, Numbering, RequestContext
from gateway.serving.service import CalibratedService
from gateway.protocol.openai import CompletionRequest, CompletionResponse, UsageInfo


def contexts(service: CalibratedService, req: CompletionRequest, domain: str, caller: Caller) -> list[RequestContext]:
    """One context per prompt, numbered on under the first one's response id."""
    prompts = req.prompts()
    if len(prompts) == 1:
        return [service.prepare_completion(req, domain, caller)]
    first = service.prepare_completion(req.model_copy(update={"prompt": prompts[0]}), domain, caller,
                                       Numbering(batched=True))
    return [first] + [service.prepare_completion(req.model_copy(update={"prompt": p}), domain, caller,
                                                 Numbering(first.response_id, i * req.n, True))
                      for i, p in enumerate(prompts[1:], start=1)]


def total(usages: list[UsageInfo]) -> UsageInfo:
    return UsageInfo(prompt_tokens=sum(u.prompt_tokens for u in usages),
                     completion_tokens=sum(u.completion_tokens for u in usages),
                     total_tokens=sum(u.total_tokens for u in usages))


async def complete(service: CalibratedService, ctxs: list[RequestContext]) -> CompletionResponse:
    try:
        async with asyncio.TaskGroup() as group:  # a failure cancels the other prompts (their engine requests aborted)
            tasks = [group.create_task(service.complete(ctx)) for ctx in ctxs]
    except ExceptionGroup as failed:  # answered as that prompt's own request would have been
        raise failed.exceptions[0] from None
    bodies = [task.result() for task in tasks]
    return bodies[0].model_copy(update={"choices": [c for body in bodies for c in body.choices],
                                        "usage": total([body.usage for body in bodies])})


async def stream(service: CalibratedService, ctxs: list[RequestContext]) -> AsyncIterator[str]:
    async for piece in interleaved([service.stream(ctx) for ctx in ctxs]):
        yield piece
    first = ctxs[0]
    if first.request.stream_options is not None and first.request.stream_options.include_usage:
        yield first.view.chunk(first.response_id, [], total([ctx.usage for ctx in ctxs]))
    yield "data: [DONE]\n\n"


async def interleaved(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The streams' pieces as each comes. The first failure is raised and the rest are cancelled, as they are when
    the consumer stops (a client gone: each stream aborts its engine request)."""
    # Bounded: a client reading slowly makes the prompts' streams wait here instead of piling up their chunks.
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(streams))
    ended = object()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece)
        except Exception as e:
            await queue.put(e)
        else:
            await queue.put(ended)

    tasks = [asyncio.get_running_loop().create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is ended:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
