"""The smaller items of issue 63 (8): feedback on an answer withheld for review, what /health tells a caller without
the admin key, deadlines for reading a request's headers (the gateway's own and HAProxy's), and key ids that could
repeat."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from calm_core.engine import EngineUnavailable
from gateway.records.handoff_store import HandoffStore, Review
from gateway.records.store import Store
from tests.servers import free_port
from tests.test_client_keys import ADMIN, ask, make_app
from tests.test_escalation_logic import QUESTION, gateway_app
from tests.test_gateway_logic import LetterEngine, science_app

REPO = Path(__file__).resolve().parents[1]
WITHHELD = {"threshold": 0.8, "action": "review", "message": "A specialist will answer."}


def no_webhook(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"nothing is posted without a webhook: {request.url}")


def test_a_callers_feedback_on_an_answer_withheld_for_review_is_refused_and_the_review_still_closes(tmp_path):
    """The caller was sent the policy's message, not the answer (confidence 0.7 < 0.8): its feedback was stored as a
    label of the model's answer, and the reviewer's verdict then met that feedback row: 409 on every verdict."""
    with TestClient(gateway_app(tmp_path, no_webhook)) as client:
        assert client.put("/admin/policies/science", json=WITHHELD, headers=ADMIN).status_code == 200
        out = client.post("/v1/chat/completions", json=QUESTION).json()
        review_id = out["choices"][0]["calibration"]["review_id"]
        feedback = client.post("/v1/feedback", json={"response_id": out["id"], "correct": True})
        closed = client.post(f"/admin/reviews/{review_id}", json={"correct": False}, headers=ADMIN)
        assert closed.status_code == 200, closed.text
        assert closed.json()["status"] == "closed" and closed.json()["recorded"]
        error = feedback.json()["error"]
        assert (feedback.status_code, error["code"], error["param"]) == (409, "withheld_for_review", "response_id")
        assert review_id in error["message"]
        # The one label of that answer is the reviewer's; the caller's is refused after the close as before it.
        assert client.app.state.gateway.store.labelled_answers("science") == ([pytest.approx(0.7)], [False])
        again = client.post("/v1/feedback", json={"response_id": out["id"], "correct": False})
        assert again.status_code == 409 and again.json()["error"]["code"] == "withheld_for_review"
        # An answer the caller did see still takes its feedback.
        assert client.put("/admin/policies/science", json={**WITHHELD, "threshold": 0.5}, headers=ADMIN).status_code == 200
        seen = client.post("/v1/chat/completions", json=QUESTION).json()
        assert seen["choices"][0]["calibration"]["review_id"] is None
        assert client.post("/v1/feedback", json={"response_id": seen["id"], "correct": True}).json()["recorded"]


def test_reviews_are_found_by_response_through_an_index_also_on_a_database_made_before_it(database):
    store = Store(database)
    HandoffStore(store)
    with store.engine.begin() as c:  # the reviews table as gateways made it before: no index on response_id
        c.execute(text("DROP INDEX IF EXISTS ix_reviews_response_id"))
    handoff = HandoffStore(store)
    assert "ix_reviews_response_id" in {i["name"] for i in inspect(store.engine).get_indexes("reviews")}
    handoff.open_reviews([Review("rev-1", "science", "chatcmpl-1", {"prompt": "q"}, "A", 0.4, 1.0)])
    assert handoff.review_of("chatcmpl-1") == "rev-1" and handoff.review_of("chatcmpl-2") is None
    store.close()


class DescribedEngine(LetterEngine):
    """An upstream engine as /health describes it, which can stop answering."""

    def __init__(self):
        super().__init__()
        self.down = False

    def describe(self) -> dict:
        return {"kind": "upstream", "urls": ["http://engine-1.internal:8000"], "engines": ["http://10.0.0.7:8000"]}

    async def check_health(self):
        if self.down:
            raise EngineUnavailable("no upstream answers /health (http://engine-1.internal:8000)")


def test_health_describes_the_deployment_to_the_admin_only(tmp_path):
    engine = DescribedEngine()
    with TestClient(science_app(tmp_path, engine)) as client:
        for headers in ({}, {"Authorization": "Bearer not-the-admin-key"}, {"Authorization": "dev-admin-key"}):
            assert client.get("/health", headers=headers).json() == {"status": "ok"}
        full = client.get("/health", headers=ADMIN).json()
        assert full["engine"]["urls"] == ["http://engine-1.internal:8000"] and full["versions"]["routes"]
        assert full["domains"] and full["artifact_version"] == "test-v1"
        engine.down = True
        for path in ("/health", "/health/ready"):
            anyone = client.get(path)
            assert anyone.status_code == 503 and anyone.headers["retry-after"] == "5"
            assert anyone.json()["error"]["message"] == "model engine unavailable"
            admin = client.get(path, headers=ADMIN)
            assert admin.status_code == 503 and "engine-1.internal" in admin.json()["error"]["message"]


async def _hello(scope, receive, send):
    if scope["type"] == "http":
        message = {"more_body": True}
        while message.get("more_body"):  # the whole body first, as the gateway's routes read it
            message = await receive()
            if message["type"] == "http.disconnect":
                return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def test_the_gateways_server_closes_a_connection_whose_headers_do_not_arrive_in_time():
    """uvicorn has no header-read timeout (its keep-alive timer stops at a request's first byte): the gateway's server
    closes a connection that sends nothing, or headers that never end, once `header_timeout_s` has passed."""
    import uvicorn

    from gateway.edge.http_server import server_config

    settings = SimpleNamespace(host="127.0.0.1", port=free_port(), drain_s=30.0, keep_alive_s=75, header_timeout_s=0.5,
                               body_timeout_s=0.5)
    config = server_config(_hello, settings)
    request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"

    async def closed_after(sent: bytes) -> float:
        began = time.monotonic()
        reader, writer = await asyncio.open_connection(settings.host, settings.port)
        writer.write(sent)
        async with asyncio.timeout(10):  # without a deadline the read waits for ever
            assert await reader.read() == b""
        writer.close()
        return time.monotonic() - began

    async def scenario():
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        try:
            async with asyncio.timeout(30):
                while not server.started:
                    await asyncio.sleep(0.01)
                reader, writer = await asyncio.open_connection(settings.host, settings.port)
                writer.write(request)
                assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
                await asyncio.sleep(1.0)  # idle between two requests: the keep-alive time, not the header deadline
                writer.write(request)
                assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
                writer.close()
            # and a body that never ends (63, found in review): the request deadline starts only once it is read
            slow_body = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{"
            return [await closed_after(b""), await closed_after(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: 1"),
                    await closed_after(slow_body)]
        finally:
            server.should_exit = True
            await task

    assert all(0.4 < seconds < 5 for seconds in asyncio.run(scenario()))


def test_haproxy_bounds_the_time_to_read_a_requests_headers_and_an_idle_kept_alive_connection():
    """HAProxy's `timeout client` counts idle time, which each byte of a slow client's headers resets (slowloris);
    `timeout http-request` bounds the whole header. tests/test_deploy.py checks the file with HAProxy's checker."""
    config = (REPO / "deploy/haproxy/haproxy.cfg").read_text()
    defaults = re.search(r"^defaults\n(.*?)(?=^\S)", config, re.MULTILINE | re.DOTALL)[1]
    timeouts = dict(re.findall(r"^\s*timeout\s+(\S+)\s+(\d+)s\s*$", defaults, re.MULTILINE))
    assert int(timeouts["http-request"]) <= 30
    assert int(timeouts["http-request"]) < int(timeouts["http-keep-alive"]) <= int(timeouts["client"])


def test_a_key_id_drawn_twice_is_drawn_again_and_keys_issued_with_short_ids_keep_working(tmp_path, monkeypatch):
    """Key ids were 4 random bytes, and a repeat made the key's creation a 500 (a primary key violated)."""
    import secrets

    from gateway.edge.keys import new_key

    drawn = iter(["0123abcd", "0123abcd", "feedfacecafebeef"])
    real = secrets.token_hex
    monkeypatch.setattr(secrets, "token_hex", lambda n=None: next(drawn))
    with TestClient(make_app(tmp_path), raise_server_exceptions=False) as http:
        first = http.post("/admin/keys", json={"name": "old"}, headers=ADMIN)
        second = http.post("/admin/keys", json={"name": "new"}, headers=ADMIN)
        assert second.status_code == 201, second.text
        assert (first.json()["id"], second.json()["id"]) == ("0123abcd", "feedfacecafebeef")
        monkeypatch.setattr(secrets, "token_hex", real)
        for created in (first, second):  # the key with an id of the old length is as valid as the new one
            assert ask(http, created.json()["key"]).choices[0].message.content == "Hi"
        assert [k["id"] for k in http.get("/admin/keys", headers=ADMIN).json()["data"]] == ["0123abcd",
                                                                                           "feedfacecafebeef"]
    assert len(new_key()[0]) == 16  # 8 random bytes: a repeat is not expected before some 5e9 keys
