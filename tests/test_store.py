"""The gateway's store on both backends through the same data layer: SQLite (the default) and a real PostgreSQL
server (Debian's, started for these tests). Two Store objects on one database stand for two gateway replicas."""

from __future__ import annotations

import threading

import pytest

from gateway.records.store import Store, VersionConflict


def test_policies_are_versioned_audited_and_durable(database):
    store = Store(database)
    assert store.put_policy("medicine", {"threshold": 0.5}, "admin") == 1
    assert store.put_policy("medicine", {"threshold": 0.7}, "admin", expected_version=1) == 2
    with pytest.raises(VersionConflict):
        store.put_policy("medicine", {"threshold": 0.9}, "admin", expected_version=1)
    assert store.delete_policy("medicine", "admin")
    assert not store.delete_policy("medicine", "admin")
    store.put_policy("default", {"threshold": 0.1}, "admin")
    store.close()
    reopened = Store(database)
    assert reopened.get_policy("default") == ({"threshold": 0.1}, 1)
    assert reopened.list_policies() == {"default": ({"threshold": 0.1}, 1)}
    log = reopened.audit_log("medicine")
    assert [e["action"] for e in log] == ["delete", "update", "create"]
    assert log[1]["before"] == {"threshold": 0.5} and log[1]["after"] == {"threshold": 0.7}


def test_feedback_is_idempotent_and_labels_come_back_in_order(database):
    store = Store(database)
    store.record_responses([("r1", "science", 0.8), ("r1#1", "science", 0.6), ("r2", "medicine", 0.3)])
    store.record_response("r1", "science", 0.1)  # an id already stored keeps its first record
    assert store.get_response("r1") == ("science", 0.8, None) and store.get_response("nope") is None
    assert store.add_feedback("r1", True) is True
    assert store.add_feedback("r1", True) is False
    assert store.add_feedback("r1", False) is None
    assert store.add_feedback("r1#1", False) is True
    assert store.recent_feedback("science") == ([0.6, 0.8], [False, True])
    assert store.labelled_answers("science") == ([0.8, 0.6], [True, False])
    assert store.labelled_domains() == ["science"]
    assert store.feedback_since("science", 0.0) == ([0.8, 0.6], [True, False])
    assert store.feedback_since("science", 2e9) == ([], [])
    at = store.record_risk_fit("science", {"threshold": 0.5}, 1, None)
    store.record_risk_fit("science", {"threshold": 0.4}, 1, {"threshold": 0.5})
    assert store.latest_risk_fits()["science"][0] == {"threshold": 0.4} and at > 0
    assert [e["action"] for e in store.audit_log("science")] == ["refit", "refit"]


def test_escalations_and_reviews_are_stored_and_judged_once(database):
    from gateway.records.handoff_store import HandoffStore, Review

    store = Store(database)
    handoff = HandoffStore(store)
    handoff.record_escalations([("chatcmpl-1", "science", 0.4, "strong", 0.9, "k1")])
    assert handoff.escalation_of("chatcmpl-1") == ("science", "k1") and handoff.escalation_of("x") is None
    assert [handoff.judge_escalation("chatcmpl-1", v) for v in (True, True, False)] == [True, False, None]
    assert store.labelled_answers("science") == ([], [])  # an escalated answer's verdict is not a first-model label
    handoff.open_reviews([Review(f"rev-{i}", "science", f"chatcmpl-r{i}", {"prompt": "q"}, "A", 0.3 + i / 10, 100.0 + i)
                          for i in range(2)])
    store.record_responses([("chatcmpl-r0", "science", 0.3), ("chatcmpl-r1", "science", 0.4)])
    assert [r.id for r in handoff.reviews()] == ["rev-0", "rev-1"]
    assert handoff.close_review("rev-0", False, "admin", "wrong") is True
    assert handoff.close_review("rev-0", False, "admin", None) is False
    assert handoff.close_review("rev-0", True, "admin", None) is None
    # A caller's feedback on the withheld answer, as gateways stored it before refusing it: the reviewer's verdict
    # replaces it, where it once kept the review open for ever (409 on every verdict; 63).
    store.add_feedback("chatcmpl-r1", True)
    assert handoff.close_review("rev-1", False, "admin", None) is True
    assert [r.id for r in handoff.reviews("closed")] == ["rev-0", "rev-1"] and handoff.review("rev-0").note == "wrong"
    assert store.labelled_answers("science") == ([0.3, 0.4], [False, False])
    with pytest.raises(LookupError):
        handoff.close_review("rev-9", True, "admin", None)
    store.close()


def test_client_keys_are_stored_hashed_and_revocable(database):
    store = Store(database)
    store.add_client_key("k1", "team", "h" * 64, ["science"], 60.0)
    store.add_client_key("k2", "other", "g" * 64, None, None)
    assert set(store.active_client_keys()) == {"h" * 64, "g" * 64}
    assert store.active_client_keys()["h" * 64].domains == ("science",)
    assert store.revoke_client_key("k1") and not store.revoke_client_key("k1")
    assert set(store.active_client_keys()) == {"g" * 64}


def test_two_replicas_share_writes_and_concurrent_policy_writers_never_lose_an_update(database):
    a, b = Store(database), Store(database)
    a.put_policy("science", {"threshold": 0.5}, "admin")
    assert b.get_policy("science") == ({"threshold": 0.5}, 1)
    # Eight writers, all expecting version 1: exactly one wins, the others get a conflict.
    results: list[object] = []

    def write(i: int):
        store = (a, b)[i % 2]
        try:
            results.append(store.put_policy("science", {"threshold": 0.6 + i / 100}, f"w{i}", expected_version=1))
        except VersionConflict:
            results.append("conflict")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(2) == 1 and results.count("conflict") == 7
    assert a.get_policy("science")[1] == 2 and len(a.audit_log("science")) == 2
    # Feedback arriving at both replicas for the same response: stored once.
    a.record_response("r", "science", 0.9)
    assert sorted(map(str, (a.add_feedback("r", True), b.add_feedback("r", True)))) == ["False", "True"]


def test_a_policy_changed_through_one_gateway_is_in_force_in_the_other(database, tmp_path):
    """Two gateway apps on one database: a PUT through the first is what the second applies, within the policy
    cache's refresh interval (here set to 0 s)."""
    from fastapi.testclient import TestClient

    from tests.test_client_keys import make_app

    key = "db_url" if "://" in database else "db_path"
    # registry_dir too: on a db_url the registry defaults to CALM_HOME's, the checkout's own (its serving list is
    # what `calm engine` there loads)
    apps = [make_app(tmp_path / str(i), **{key: database, "registry_dir": tmp_path / str(i) / "registry"})
            for i in range(2)]
    for app in apps:
        app.state.gateway.shared.policies.max_age_s = 0.0
    admin = {"Authorization": "Bearer dev-admin-key"}
    body = {"model": "m", "max_tokens": 2, "metadata": {"domain": "science"}, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        assert second.post("/v1/chat/completions", json=body).json()["choices"][0]["calibration"]["policy"] == "builtin"
        assert first.put("/admin/policies/science", json={"threshold": 0.99, "action": "abstain"}, headers=admin).status_code == 200
        # A stale cache is served while a thread reads the store (never on the event loop): in force within a read.
        for _ in range(200):
            cal = second.post("/v1/chat/completions", json=body).json()["choices"][0]["calibration"]
            if cal["policy"] != "builtin":
                break
        assert cal["policy"] == "science:v1" and cal["abstained"]


def test_a_failing_database_answers_503_and_keeps_what_was_stored(tmp_path):
    """The database fails (locked past its timeout, disk full, server gone): requests that write get a clear 503 in
    the OpenAI error shape, not a 500, and what was stored before is intact once it recovers."""
    from fastapi.testclient import TestClient
    from sqlalchemy.exc import OperationalError

    from tests.test_client_keys import make_app

    app = make_app(tmp_path)
    store = app.state.gateway.store
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as http:
        first = http.post("/v1/chat/completions", json=body).json()["id"]
        assert http.post("/v1/feedback", json={"response_id": first, "correct": True}).status_code == 200
        healthy = store.record_responses

        def full(*args, **kwargs):
            raise OperationalError("INSERT", {}, Exception("database or disk is full"))

        store.record_responses = full
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "storage_unavailable"
        assert r.headers["Retry-After"] == "5" and "Traceback" not in r.text
        store.record_responses = healthy
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert store.get_response(first) is not None and store.recent_feedback("other") == ([store.get_response(first)[1]], [True])


def test_replicas_starting_together_on_an_empty_postgresql_create_the_tables_once(postgres_url):
    """Gateway replicas and the worker start at the same moment on a new database: the tables are created under an
    advisory lock (two concurrent CREATE TABLEs of one name fail in PostgreSQL's catalog; tests/test_fleet.py met it)."""
    import threading

    import psycopg
    from sqlalchemy import inspect
    from sqlalchemy.engine import make_url

    from calm_core.db import Database
    from calm_core.jobs import JobQueue
    from calm_core.registry import Registry

    server = make_url(postgres_url)
    with psycopg.connect(host=server.host, port=server.port, user=server.username, dbname="postgres",
                         autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS race")
        conn.execute("CREATE DATABASE race")
    url = server.set(database="race").render_as_string(hide_password=False)
    start, errors = threading.Barrier(6), []

    def open_one(make):
        start.wait()
        try:
            make()
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    makers = [lambda: Store(url), lambda: Store(url), lambda: Store(url), lambda: Registry(Database(url), "/tmp/r"),
              lambda: JobQueue(Database(url)), lambda: Store(url)]
    threads = [threading.Thread(target=open_one, args=(m,)) for m in makers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store = Store(url)
    try:
        assert {"policies", "feedback", "artifact_versions", "retrain_jobs"} <= set(inspect(store.engine).get_table_names())
    finally:
        store.close()


def test_served_answers_keep_their_scores_and_take_the_verdict_of_feedback_and_reviews(database):
    from calm_core.served_answers import ServedAnswer, judged_choices, judged_free_form
    from gateway.records.handoff_store import HandoffStore, Review

    store = Store(database)
    mc = ServedAnswer("v1", "multiple_choice", 0.7, None, 0, (0.7, 0.2, 0.1))
    store.record_responses([
        ("a", "science", 0.7, mc),
        ("b", "science", 0.6, ServedAnswer("v1", "multiple_choice", 0.6, None, 1, (0.3, 0.6, 0.1))),
        ("c", "science", 0.5, ServedAnswer("v0", "multiple_choice", 0.5, None, 0, (0.5, 0.5))),  # another version
        ("d", "science", 0.4, ServedAnswer("v1", "free_form", 0.4, "token")),  # free form: no option scores
        ("e", "science", 0.9, mc), ("f", "science", 0.3)])  # no record of its scores
    for key in ("a", "c", "d", "f"):
        assert store.add_feedback(key, key != "a") is True
    handoff = HandoffStore(store)
    handoff.open_reviews([Review("rev-1", "science", "e", {"messages": []}, "A", 0.9, 0.0)])
    assert handoff.close_review("rev-1", True, "admin", None) is True
    judged = judged_choices(store, "science", "v1")  # "b" has no verdict yet
    assert [(j.chosen, j.correct) for j in judged] == [(0, False), (0, True)]
    assert judged[0].log_probs == pytest.approx([-0.356675, -1.609438, -2.302585], abs=1e-6)
    assert judged_choices(store, "medicine", "v1") == [] and len(judged_choices(store, "science", "v0")) == 1
    # A free-form answer's verdict is a label for the token temperature: its served token confidence and the verdict.
    store.record_responses([("g", "science", 0.8, ServedAnswer("v1", "free_form", 0.8, "token")),
                            ("h", "science", 0.7, ServedAnswer("v1", "free_form", 0.7, "semantic"))])  # not a token one
    assert store.add_feedback("g", False) is True and store.add_feedback("h", True) is True
    assert [(j.confidence, j.correct) for j in judged_free_form(store, "science", "v1")] == [(0.4, True), (0.8, False)]
    assert judged_free_form(store, "science", "v0") == []


def test_a_write_that_may_not_wait_declines_on_a_busy_sqlite_and_keeps_the_wal_bounded(tmp_path):
    """A request alone has its record written on the event loop (gateway/records/group_commit.py), so that write must never
    wait for SQLite's lock (held by another process, or by this one's worker thread), must survive a failed statement,
    and never checkpoints the WAL itself: the WAL stays bounded when such writes carry all the traffic (one in
    CHECKPOINT_EVERY declines)."""
    import os
    import sqlite3
    import time

    from calm_core.db import CHECKPOINT_EVERY
    from calm_core.served_answers import ServedAnswer

    path = tmp_path / "gateway.sqlite3"
    store = Store(str(path))
    served = ServedAnswer("v1", "free_form", 0.5, "token")

    def record(i: int, wait: bool = False) -> bool:
        return store.record_responses([(f"chatcmpl-{i:024d}", "science", 0.5, served)], wait=wait)

    assert record(0) is True
    other_process = sqlite3.connect(path, isolation_level=None)
    other_process.execute("BEGIN IMMEDIATE")
    began = time.monotonic()
    assert record(1) is False
    assert time.monotonic() - began < 10  # declined at once, not after the store's 30 s busy timeout
    other_process.execute("ROLLBACK")
    other_process.close()
    with store._write_lock:  # this process's worker thread in a write
        began = time.monotonic()
        assert record(2) is False
        assert time.monotonic() - began < 10
    assert store.get_response(f"chatcmpl-{1:024d}") is None and store.get_response(f"chatcmpl-{2:024d}") is None
    with pytest.raises(sqlite3.IntegrityError):  # a failed statement is rolled back; the next write goes on
        store.record_responses([("broken", None, 0.5)], wait=False)
    declined = 0
    for i in range(3, 3003):
        if not record(i):
            declined += 1
            assert record(i, wait=True) is True
    assert declined == pytest.approx(3000 / CHECKPOINT_EVERY, abs=2)
    assert store.get_response(f"chatcmpl-{3002:024d}") == ("science", 0.5, None)
    wal_pages = os.path.getsize(f"{path}-wal") / 4096
    assert wal_pages < 1500, wal_pages  # SQLite checkpoints at 1,000; without the declines: ~5 a record
    store.close()
