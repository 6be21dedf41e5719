"""The event loop never waits on the database (63, item 7): admin routes hand their store calls to threads, and a
PostgreSQL server that accepts connections and never answers fails them in seconds instead of hanging."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
from sqlalchemy.exc import OperationalError

from calm_core.db import Database
from tests.test_client_keys import make_app

ADMIN = {"Authorization": "Bearer dev-admin-key"}


def test_a_slow_database_under_an_admin_route_does_not_hold_the_liveness_probe(tmp_path):
    """On the previous main the audit route called the store on the event loop: /health/live waited for it."""
    app = make_app(tmp_path)
    release, entered = threading.Event(), threading.Event()
    store = app.state.gateway.store

    def slow_audit(domain, limit):
        entered.set()
        release.wait(timeout=10)  # a database that takes its time (bounded, so a regression fails instead of hanging)
        return []

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            audit = asyncio.ensure_future(client.get("/admin/audit", headers=ADMIN))
            while not entered.is_set() and not audit.done():  # the admin call is now inside the store (or failed)
                await asyncio.sleep(0.01)
            live = await client.get("/health/live")
            still_waiting = not audit.done()
            release.set()
            return live.status_code, still_waiting, (await audit).status_code

    store.audit_log = slow_audit
    from fastapi.testclient import TestClient

    with TestClient(app):  # the app's start-up (lifespan) before the requests
        assert asyncio.run(go()) == (200, True, 200)


def test_a_postgresql_server_that_never_answers_fails_the_connection_in_seconds():
    silent = socket.socket()  # accepts the TCP connection and never speaks PostgreSQL's protocol
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    outcome: list = []

    def ping():
        started = time.monotonic()
        try:
            Database(f"postgresql+psycopg://calm:calm@127.0.0.1:{silent.getsockname()[1]}/calm").ping()
        except OperationalError as e:
            outcome.append((time.monotonic() - started, e))

    try:
        worker = threading.Thread(target=ping, daemon=True)
        worker.start()
        worker.join(timeout=60)  # libpq's default is to wait for ever: the previous main never returned here
        assert not worker.is_alive() and outcome, "the connection attempt is still waiting"
        assert outcome[0][0] < 30 and "timeout" in str(outcome[0][1]).lower()
    finally:
        silent.close()



def test_a_stale_cache_is_read_again_in_a_thread_while_the_loop_serves_the_last_value():
    """Policies, keys and capture settings were read again on the event loop when stale: a slow store held every
    request. Now the loop serves the last value while one thread reads; a failed read keeps the last value."""
    from gateway.records.cached import CachedRead

    now, release, reads = [0.0], threading.Event(), []

    def read():
        reads.append(threading.current_thread() is threading.main_thread())
        if len(reads) == 1:
            return "v1"
        release.wait(timeout=10)
        if len(reads) == 2:
            raise OSError("the database is gone")
        return "v3"

    cache = CachedRead(read, max_age_s=5.0, clock=lambda: now[0])

    async def go():
        assert cache.get() == "v1"  # the first read happens where it is asked
        now[0] = 10.0
        assert cache.get() == "v1" and cache.get() == "v1"  # stale: served at once, one read started in a thread
        release.set()
        while len(reads) < 2 or cache._reading:
            await asyncio.sleep(0.01)
        assert cache.get() == "v1"  # that read failed: the last value stays, and another read starts
        while cache.get() != "v3":
            await asyncio.sleep(0.01)
        return reads

    assert asyncio.run(go()) == [True, False, False]
