"""Client API keys through the official openai client against the gateway app (a fake engine: these are tests of the
key logic; the real engine is exercised elsewhere)."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from gateway.edge.keys import KeyRing, TokenBucket, hash_key
from gateway.records.store import Store
from tests.test_gateway_logic import FailingEngine, _tiny_tokenizer

ADMIN = {"Authorization": "Bearer dev-admin-key"}


class QuietEngine(FailingEngine):
    def __init__(self):
        super().__init__(None)

    def describe(self) -> dict:
        return {"kind": "fake"}


def make_app(tmp_path, engine=None, **settings):
    from calm_core.artifact import ArtifactManifest, LoadedArtifact
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    manifest = ArtifactManifest.model_construct(reference_histograms={}, answer_format="letter", applies_to="all",
                                                has_adapter=False, artifact_version="test-v1", free_form_version=None)
    artifact = LoadedArtifact.__new__(LoadedArtifact)
    object.__setattr__(artifact, "manifest", manifest)
    settings.setdefault("db_path", tmp_path / "g.db")
    return create_app(GatewaySettings(served_model_name="m", domains=["science", "medicine"], **settings), engine or QuietEngine(),
                      _tiny_tokenizer(), artifact)


def ask(http: TestClient, key: str, domain: str = "science"):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
    return client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                          metadata={"domain": domain})


def test_keys_are_required_in_production_restricted_to_domains_rate_limited_and_revocable(tmp_path):
    app = make_app(tmp_path, environment="production", admin_key="a-real-admin-key")
    admin = {"Authorization": "Bearer a-real-admin-key"}
    with TestClient(app) as http:
        with pytest.raises(openai.AuthenticationError, match="not valid"):
            ask(http, "sk-anything")
        r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        # The admin key is not a client key, and a client key is not an admin key.
        with pytest.raises(openai.AuthenticationError):
            ask(http, "a-real-admin-key")
        created = http.post("/admin/keys", json={"name": "team-a", "domains": ["science"], "requests_per_minute": 3},
                            headers=admin)
        assert created.status_code == 201, created.text
        key = created.json()["key"]
        assert http.get("/admin/keys", headers={"Authorization": f"Bearer {key}"}).status_code == 403
        assert ask(http, key).choices[0].message.content == "Hi"
        with pytest.raises(openai.PermissionDeniedError, match="domain 'medicine'"):
            ask(http, key, "medicine")
        ask(http, key)
        ask(http, key)  # three requests per minute: the burst is spent (the refused one took no token)
        with pytest.raises(openai.RateLimitError) as limited:
            ask(http, key)
        assert int(limited.value.response.headers["Retry-After"]) >= 1
        assert limited.value.response.json()["error"]["type"] == "rate_limit_error"
        metrics = http.get("/metrics").text
        assert 'calm_requests_total{domain="science",endpoint="chat",status="429"} 1.0' in metrics
        # Stored hashed: the key itself is nowhere in the database.
        listed = http.get("/admin/keys", headers=admin).json()["data"]
        assert [k["name"] for k in listed] == ["team-a"] and "key" not in listed[0]
        assert key.encode() not in (tmp_path / "g.db").read_bytes()
        assert http.delete(f"/admin/keys/{created.json()['id']}", headers=admin).status_code == 200
        with pytest.raises(openai.AuthenticationError, match="revoked"):
            ask(http, key)
        assert http.delete(f"/admin/keys/{created.json()['id']}", headers=admin).status_code == 404
        bad = http.post("/admin/keys", json={"name": "x", "requests_per_minute": -1}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["param"]


def test_development_lets_placeholder_keys_through_but_checks_calm_keys(tmp_path):
    app = make_app(tmp_path)
    with TestClient(app) as http:
        assert ask(http, "unused").choices[0].message.content == "Hi"  # the docs' placeholder keeps working
        with pytest.raises(openai.AuthenticationError):
            ask(http, "calm-deadbeef-not-a-real-secret")  # a calm key that is wrong is refused, not ignored
        key = http.post("/admin/keys", json={"name": "dev"}, headers=ADMIN).json()["key"]
        assert ask(http, key, "medicine").choices[0].message.content == "Hi"  # no domain list: every domain


def test_a_revocation_by_another_replica_reaches_this_one_within_the_refresh_interval(tmp_path):
    from gateway.edge.keys import issue_key

    now = [0.0]
    store = Store(tmp_path / "shared.db")
    ring = KeyRing(Store(tmp_path / "shared.db"), required=True, clock=lambda: now[0])
    created = issue_key(store, "k", None, None)
    assert ring.authenticate(f"Bearer {created.key}").id == created.id
    store.revoke_client_key(created.id)
    assert ring.authenticate(f"Bearer {created.key}").id == created.id  # cached
    now[0] += 6.0
    with pytest.raises(Exception, match="revoked"):
        ring.authenticate(f"Bearer {created.key}")
    assert hash_key(created.key) not in store.active_client_keys()


def test_token_bucket_refills_at_the_rate():
    bucket = TokenBucket(per_minute=60, now=0.0)
    assert all(bucket.take(0.0) == 0.0 for _ in range(60))
    assert bucket.take(0.0) == pytest.approx(1.0)
    assert bucket.take(0.5) == pytest.approx(0.5)
    assert bucket.take(1.0) == 0.0


def test_feedback_comes_from_the_key_that_got_the_answer_or_a_labeller(tmp_path):
    """Any key could judge any answer it knew the id of, and feedback moves every caller's thresholds (63, item 4):
    guaranteed-risk fits, labelled recalibration, the retraining gate. Now only the receiving key, or a key granted the
    labeller role, may; each verdict is stored with the key that gave it."""
    from fastapi.testclient import TestClient
    from sqlalchemy import select

    from gateway.records.store import FEEDBACK
    from gateway.serving.wire import response_key

    with TestClient(make_app(tmp_path, require_api_keys=True)) as http:
        keys = {name: http.post("/admin/keys", json={"name": name, **extra}, headers=ADMIN).json()
                for name, extra in (("asker", {}), ("other", {}), ("team", {"labeller": True}))}
        assert keys["team"]["labeller"] and not keys["asker"]["labeller"]
        bearer = {name: {"Authorization": f"Bearer {k['key']}"} for name, k in keys.items()}
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        ids = [http.post("/v1/chat/completions", json=body, headers=bearer["asker"]).json()["id"] for _ in range(2)]
        refused = http.post("/v1/feedback", json={"response_id": ids[0], "correct": False}, headers=bearer["other"])
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "not_your_answer", refused.text
        assert http.post("/v1/feedback", json={"response_id": ids[0], "correct": True},
                         headers=bearer["asker"]).status_code == 200
        assert http.post("/v1/feedback", json={"response_id": ids[1], "correct": False},
                         headers=bearer["team"]).status_code == 200
        store = http.app.state.gateway.store
        with store.engine.connect() as c:
            stored = dict(c.execute(select(FEEDBACK.c.response_id, FEEDBACK.c.key_id)).all())
        assert stored == {response_key(ids[0], 0): keys["asker"]["id"], response_key(ids[1], 0): keys["team"]["id"]}


def test_a_keys_engine_work_is_limited_per_minute_across_replicas(database, tmp_path):
    """Rate limits counted requests, per replica (63, item 5): one request scoring options token by token costs the
    engines tens of requests' work, and N replicas allowed N times the rate. A key's `sequences_per_minute` counts the
    engine sequences its requests started, summed over the replicas sharing the database."""
    key = "db_url" if "://" in database else "db_path"
    apps = [make_app(tmp_path / str(i), **{key: database, "registry_dir": tmp_path / str(i) / "registry",
                                           "require_api_keys": True}) for i in range(2)]
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}  # 2 sequences each
    with TestClient(apps[0]) as first, TestClient(apps[1]) as second:
        created = first.post("/admin/keys", json={"name": "metered", "sequences_per_minute": 4}, headers=ADMIN).json()
        assert created["sequences_per_minute"] == 4
        for app in apps:
            app.state.gateway.keyring.refresh()
            app.state.gateway.usage.wall = lambda: 1_800_000_030.0  # one minute for the whole test, half of it left
        bearer = {"Authorization": f"Bearer {created['key']}"}
        assert [first.post("/v1/chat/completions", json=body, headers=bearer).status_code for _ in range(2)] == [200, 200]
        apps[0].state.gateway.usage.refresh()  # its sync: what the next tick of usage_sync_s does
        apps[1].state.gateway.usage.refresh()
        refused = second.post("/v1/chat/completions", json=body, headers=bearer)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "engine_rate_limit_exceeded"
        assert refused.headers["Retry-After"] == "30"
        unmetered = first.post("/admin/keys", json={"name": "free"}, headers=ADMIN).json()
        apps[1].state.gateway.keyring.refresh()
        assert second.post("/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {unmetered['key']}"}).status_code == 200
