"""How far an answer travels (64, item 2): the project files on the call stack from the router to the engine client,
for a streamed free-form answer and a multiple-choice answer. The request path is the router, the endpoint table, the
service and the scorer; a deeper chain means a layer crept in between."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest

from tests.test_gateway_logic import FailingEngine, LetterEngine, science_app

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tuple(str(ROOT / package) + "/" for package in ("gateway", "calm_core", "adapters"))
MAX_FILES = 8  # router to engine client, the engine client included


def project_files(frame) -> list[str]:
    """The project files on a frame's stack, innermost first."""
    files = []
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PROJECT) and (rel := str(Path(name).relative_to(ROOT))) not in files:
            files.append(rel)
        frame = frame.f_back
    return files


def stack_at_the_engine(app, engine, body: dict) -> list[str]:
    """The project files on the way to the engine's first `stream` call, outermost first: the call stack, continued
    through every task spawn (a task's stack ends at the event loop; where it was created continues it)."""
    found: list[str] = []
    spawned_at: dict[int, list[str]] = {}  # id(coroutine) -> the files on the way to its task's creation
    create_task = asyncio.BaseEventLoop.create_task.__code__

    def way_here(frame) -> list[str]:
        task = asyncio.current_task()
        before = spawned_at.get(id(task.get_coro()), []) if task is not None else []
        return project_files(frame) + [f for f in before if f not in project_files(frame)]

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code is create_task:
            spawned_at[id(frame.f_locals["coro"])] = way_here(frame.f_back)
        elif frame.f_code is type(engine).stream.__code__ and not found:
            found.extend(way_here(frame.f_back))

    async def ask():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                sys.setprofile(profile)
                try:
                    response = await client.post("/v1/chat/completions", json=body)
                finally:
                    sys.setprofile(None)
                assert response.status_code == 200, response.text

    asyncio.run(ask())
    return found[::-1]


@pytest.mark.parametrize("engine, body, scorer", [
    (FailingEngine(None), {"stream": True, "messages": [{"role": "user", "content": "hello"}]},
     "calm_core/scorers/free_form.py"),
    (LetterEngine(), {"messages": [{"role": "user", "content": "hello"}], "options": ["A", "B"]},
     "calm_core/scorers/options.py"),
], ids=["streamed free-form", "multiple choice"])
def test_an_answer_passes_through_few_files_from_router_to_engine(tmp_path, engine, body, scorer):
    files = stack_at_the_engine(science_app(tmp_path, engine), engine, {"model": "m", "max_tokens": 4, **body})
    print(files)
    assert "gateway/routers/openai.py" in files and "gateway/serving/service.py" in files and scorer in files
    assert len(files) + 1 <= MAX_FILES, files  # + the engine client (a fake here; adapters/clients/ when served)
