"""`calm eval --gateway` when the gateway refuses a question part-way (a fake engine that fails after some answers; the
real gateway is evaluated end to end in tests/test_gateway_default.py): one clear error that says what to do, the
answers so far kept, and the same command resuming from them."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from calm_core.engine import EngineUnavailable
from calm_core.errors import CalmError
from tests.test_client_keys import make_app
from tests.test_gateway_logic import LetterEngine


class TiringEngine(LetterEngine):
    """Answers `answers` questions, then is unavailable (as an upstream engine whose queue outgrew the timeout)."""

    def __init__(self, answers: int):
        super().__init__()
        self.left = answers

    async def draw(self, request):
        self.left -= 1
        if self.left < 0:
            raise EngineUnavailable("upstream http://127.0.0.1:8001 timed out")
        async for delta in super().draw(request):
            yield delta


def evaluate(monkeypatch, app, out):
    from training import gateway_eval
    from training.dataset_spec import DatasetSpec

    http = TestClient(app)
    monkeypatch.setattr(gateway_eval, "_client", lambda cfg: openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0))
    cfg = gateway_eval.GatewayEvalConfig(url="http://testserver", datasets=(DatasetSpec.parse("arc_easy"),), limit=6,
                                         concurrency=1, out_dir=str(out), n_boot=10)
    with http:
        return gateway_eval.run_gateway_eval(cfg, show_progress=False)


def test_a_refused_question_stops_the_run_with_what_to_do_and_the_same_command_resumes(tmp_path, monkeypatch,
                                                                                        shared_data):
    out = tmp_path / "report"
    with pytest.raises(CalmError) as stopped:
        evaluate(monkeypatch, make_app(tmp_path, TiringEngine(answers=4)), out)
    message = str(stopped.value)
    assert "answered 503: model engine unavailable: upstream http://127.0.0.1:8001 timed out" in message
    assert "the same command resumes" in message and "--concurrency, 1 now" in message
    kept = [json.loads(line) for line in (out / "answers_arc_easy_test.jsonl").read_text().splitlines()]
    assert len(kept) == 3  # the probe's answer is not kept; the next three are, and nothing after the refusal is asked
    report = evaluate(monkeypatch, make_app(tmp_path, TiringEngine(answers=4)), out)
    assert report is not None and len((out / "answers_arc_easy_test.jsonl").read_text().splitlines()) == 6
