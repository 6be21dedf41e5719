"""The gateway's side of the retraining loop through its HTTP API, on fake engines (tests of routing, swapping and
validation logic; tests/test_retrain_loop.py runs the whole loop on the real engine, Prometheus and Alertmanager):
the Alertmanager webhook, traffic capture, the registry endpoints, and per-domain hot swap."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

from fastapi.testclient import TestClient

from calm_core.artifact import load_artifact, update_manifest
from calm_core.capture import Capture
from calm_core.db import Database
from calm_core.jobs import JobQueue
from calm_core.paths import BUNDLED_DIR
from calm_core.registry import Registry
from tests.test_gateway_logic import LetterEngine, _tiny_tokenizer

ADMIN = {"Authorization": "Bearer dev-admin-key"}
SHIPPED = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"


def artifact_copy(tmp_path, version: str):
    """The shipped artifact as another version, answering multiple choice by letter (what the fake engine does)."""
    out = tmp_path / "sources" / version
    shutil.copytree(SHIPPED, out)
    update_manifest(out, artifact_version=version, answer_format="letter", free_form_version=None)
    shutil.rmtree(out / "free_form")
    return out


class VersionEngine(LetterEngine):
    """Answers like LetterEngine as one artifact version; requests wait while `hold` is set; remembers being closed."""

    def __init__(self, version: str):
        super().__init__()
        self.artifact_version = version
        self.hold = threading.Event()
        self.closed = False

    async def draw(self, request):
        while self.hold.is_set():
            await asyncio.sleep(0.01)
        # Multiple choice as LetterEngine; free form one token ("Hi"), as FailingEngine without its failure.
        stream = super().draw if request.option_token_ids else super(LetterEngine, self).draw
        async for delta in stream(request):
            yield delta

    async def close(self):
        self.closed = True

    def describe(self) -> dict:
        return {"kind": "fake", "version": self.artifact_version}


def make_app(tmp_path, with_loader: bool = True):
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    v1 = artifact_copy(tmp_path, "v1")
    engines: dict[str, VersionEngine] = {"v1": VersionEngine("v1")}

    async def load_version(version, path):  # as calm_cli's: the artifact verified before any engine starts
        artifact = load_artifact(path)
        engines[version] = VersionEngine(version)
        return engines[version], artifact

    settings = GatewaySettings(db_path=tmp_path / "g.db", served_model_name="m", registry_poll_s=0.05,
                               domains=["science", "medicine"])
    app = create_app(settings, engines["v1"], _tiny_tokenizer(), load_artifact(v1),
                     load_version=load_version if with_loader else None)
    return app, engines, settings


def ask(client, domain: str, question: str = "hello"):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": question}],
                                                  "options": ["x", "y"], "metadata": {"domain": domain}})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["calibration"]["artifact_version"]


def wait_for(predicate, timeout=120.0):  # a deadline for a hang, not a speed requirement
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_promotion_and_rollback_swap_a_domain_without_restart_and_requests_in_flight_finish_on_the_old_version(tmp_path):
    app, engines, settings = make_app(tmp_path)
    registry = Registry(Database(settings.database), settings.registry_root)
    registry.add(artifact_copy(tmp_path, "v2"), trigger="operator", domain="science")
    with TestClient(app) as client:
        assert ask(client, "science") == "v1" and ask(client, "medicine") == "v1"

        # A request holds v1 while v2 is promoted for science.
        engines["v1"].hold.set()
        pool = __import__("concurrent.futures").futures.ThreadPoolExecutor(1)
        in_flight = pool.submit(ask, client, "science")
        assert wait_for(lambda: app.state.gateway.deployments.for_domain("science").in_flight == 1)
        r = client.post("/admin/artifacts/v2/promote", json={"domain": "science"}, headers=ADMIN)
        assert r.status_code == 200 and r.json() == {"version": "v2", "domain": "science", "previous": None}
        assert wait_for(lambda: app.state.gateway.deployments.version_for("science") == "v2")
        assert ask(client, "science") == "v2"  # new requests: the new version
        engines["v1"].hold.clear()
        assert in_flight.result(timeout=120) == "v1"  # the request already running finished on the old one
        assert ask(client, "medicine") == "v1"  # other domains: the default
        assert not engines["v1"].closed  # still the default for every other domain
        metrics = client.get("/metrics").text
        assert 'calm_serving_version_info{domain="science",version="v2"} 1.0' in metrics
        health = client.get("/health", headers=ADMIN).json()["versions"]
        assert health["routes"] == {"*": "v1", "science": "v2"}

        r = client.post("/admin/domains/science/rollback", headers=ADMIN)
        assert r.status_code == 200 and r.json()["version"] is None and r.json()["previous"] == "v2"
        assert wait_for(lambda: app.state.gateway.deployments.version_for("science") == "v1")
        assert ask(client, "science") == "v1"
        assert wait_for(lambda: engines["v2"].closed)  # a version nothing serves is closed once drained
        listed = {a["version"]: a for a in client.get("/admin/artifacts", headers=ADMIN).json()["data"]}
        assert listed["v2"]["status"] == "retired" and listed["v1"]["active_for"] == ["*"]

        # Errors are clear 4xx answers in the OpenAI shape.
        r = client.post("/admin/artifacts/nope/promote", json={"domain": "science"}, headers=ADMIN)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert client.post("/admin/domains/science/rollback", headers=ADMIN).status_code == 404
        assert client.post("/admin/artifacts/v2/promote", json={"domain": "astrology"}, headers=ADMIN).status_code == 404
        assert client.post("/admin/artifacts/v2/promote", json={"domain": "Not A Domain"}, headers=ADMIN).status_code == 400
        assert client.get("/admin/artifacts/v2", headers=ADMIN).json()["trigger"] == "operator"
        assert client.get("/admin/artifacts", headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.get("/admin/artifacts").status_code == 401


def test_a_version_that_cannot_load_is_reported_and_the_current_one_keeps_serving(tmp_path):
    app, engines, settings = make_app(tmp_path, with_loader=False)  # an upstream engine: one artifact only
    registry = Registry(Database(settings.database), settings.registry_root)
    registry.add(artifact_copy(tmp_path, "v2"), trigger="operator")
    with TestClient(app) as client:
        assert client.post("/admin/artifacts/v2/promote", json={"domain": "science"}, headers=ADMIN).status_code == 200
        assert wait_for(lambda: "v2" in app.state.gateway.deployments.problems)
        assert ask(client, "science") == "v1"
        assert "one artifact" in client.get("/health", headers=ADMIN).json()["versions"]["problems"]["v2"]


def test_answers_pinned_to_another_version_stay_out_of_the_domains_drift_window(tmp_path):
    app, engines, settings = make_app(tmp_path)
    Registry(Database(settings.database), settings.registry_root).add(artifact_copy(tmp_path, "v2"), trigger="operator",
                                                                      domain="science")

    def window() -> float:
        line = next(x for x in client.get("/metrics").text.splitlines()
                    if x.startswith('calm_drift_window_size{domain="science"}'))
        return float(line.split()[-1])

    with TestClient(app) as client:
        assert client.post("/admin/artifacts/v2/promote", json={"domain": "science"}, headers=ADMIN).status_code == 200
        assert wait_for(lambda: app.state.gateway.deployments.version_for("science") == "v2")
        assert ask(client, "science") == "v2" and window() == 1
        pinned = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hello"}], "options": ["x", "y"],
            "metadata": {"domain": "science"}, "calm": {"version": "v1"}})
        assert pinned.json()["choices"][0]["calibration"]["artifact_version"] == "v1"
        assert window() == 1  # counted as an answer of the domain, not measured against v2's reference
        assert 'calm_answers_total{domain="science"} 2.0' in client.get("/metrics").text
        assert ask(client, "science") == "v2" and window() == 2


def alert(domain: str, status: str = "firing", name: str = "CalmConfidenceDrift") -> dict:
    return {"status": status, "labels": {"alertname": name, "domain": domain, "severity": "warning"},
            "annotations": {"summary": "drift"}, "startsAt": "2026-11-30T00:00:00Z", "fingerprint": f"fp-{domain}"}


def test_alertmanager_webhook_queues_one_job_per_drifting_domain(tmp_path):
    app, _, settings = make_app(tmp_path)
    payload = {"version": "4", "status": "firing", "receiver": "calm", "groupKey": "{}:{}", "truncatedAlerts": 0,
               "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
               "alerts": [alert("science"), alert("medicine", "resolved"), alert("astrology"),
                          alert("medicine", name="CalmAbstentionSpike")]}
    with TestClient(app) as client:
        assert client.post("/admin/alerts", json=payload).status_code == 401
        assert client.post("/admin/alerts", json=payload, headers={"Authorization": "Bearer nope"}).status_code == 403
        r = client.post("/admin/alerts", json=payload, headers=ADMIN)
        assert r.status_code == 202, r.text
        jobs = r.json()["jobs"]
        assert [(j["domain"], j["status"], j["created"]) for j in jobs] == [("science", "queued", True)]
        again = client.post("/admin/alerts", json=payload, headers=ADMIN).json()["jobs"]
        assert again[0]["id"] == jobs[0]["id"] and not again[0]["created"]  # Alertmanager repeats: one job
        # The job done, the same alert episode repeated (its candidate serves; the alert has not resolved yet): no
        # second job. A new episode (the alert fired again later) starts one.
        app.state.gateway.jobs.finish(jobs[0]["id"], "promoted")
        repeat = client.post("/admin/alerts", json=payload, headers=ADMIN).json()["jobs"]
        assert [(j["id"], j["status"], j["created"]) for j in repeat] == [(jobs[0]["id"], "promoted", False)]
        later = {**payload, "alerts": [{**alert("science"), "startsAt": "2026-12-01T00:00:00Z"}]}
        fresh = client.post("/admin/alerts", json=later, headers=ADMIN).json()["jobs"]
        assert fresh[0]["created"] and fresh[0]["id"] != jobs[0]["id"]
        app.state.gateway.jobs.finish(fresh[0]["id"], "failed")

        for bad in ({"version": "4"}, {**payload, "version": "3"}, {**payload, "alerts": [{"status": "odd"}]}, [1]):
            r = client.post("/admin/alerts", json=bad, headers=ADMIN)
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        r = client.post("/admin/alerts", content=b"{not json", headers={**ADMIN, "content-type": "application/json"})
        assert r.status_code == 400

        listed = client.get("/admin/jobs", headers=ADMIN).json()["data"]
        assert [j["id"] for j in listed] == [fresh[0]["id"], jobs[0]["id"]] and listed[1]["trigger"] == "alert"
        assert client.get(f"/admin/jobs/{jobs[0]['id']}", headers=ADMIN).json()["detail"]["fingerprint"] == "fp-science"
        assert client.get("/admin/jobs/ffff", headers=ADMIN).status_code == 404
        r = client.post("/admin/jobs", json={"domain": "medicine"}, headers=ADMIN)
        assert r.status_code == 201 and r.json()["trigger"] == "operator" and r.json()["created"]
        assert client.post("/admin/jobs", json={"domain": "astrology"}, headers=ADMIN).status_code == 404
    assert len(JobQueue(Database(settings.database)).list()) == 3


def test_a_drift_alert_about_a_version_the_domain_is_no_longer_routed_to_queues_no_job(tmp_path):
    """The shipped rule labels a drift alert with the version whose window it measured. A promotion reaches the
    registry before the replicas serve it; if the alert resolves meanwhile (a failed scrape drops its series) and fires
    again, that new episode is about the parent and must not retrain the candidate (seen once in the suite)."""
    # No loader: this replica never serves v2, as one still starting it would not (deterministically).
    app, _, settings = make_app(tmp_path, with_loader=False)
    registry = Registry(Database(settings.database), settings.registry_root)
    registry.add(artifact_copy(tmp_path, "v2"), trigger="alert", domain="science")

    def payload(version: str | None, starts: str) -> dict:
        firing = alert("science")
        labels = {**firing["labels"], **({"version": version} if version else {})}
        return {"version": "4", "status": "firing", "receiver": "calm",
                "alerts": [{**firing, "labels": labels, "startsAt": starts}]}

    with TestClient(app) as client:
        first = client.post("/admin/alerts", json=payload("v1", "2026-12-03T17:37:08Z"), headers=ADMIN).json()
        assert [(j["domain"], j["created"]) for j in first["jobs"]] == [("science", True)] and first["ignored"] == []
        app.state.gateway.jobs.finish(first["jobs"][0]["id"], "promoted")
        registry.promote("v2", "science", actor="worker")
        assert wait_for(lambda: "v2" in app.state.gateway.deployments.problems)  # polled: not loaded here
        assert app.state.gateway.deployments.version_for("science") == "v1"
        again = client.post("/admin/alerts", json=payload("v1", "2026-12-03T17:39:24Z"), headers=ADMIN).json()
        assert again["jobs"] == [] and [(i["domain"], i["version"]) for i in again["ignored"]] == [("science", "v1")]
        assert "now routed to v2" in again["ignored"][0]["reason"]
        # The candidate's own window drifting is a new alert: it queues a job, as does an alert without the label (an
        # operator's own rule).
        fresh = client.post("/admin/alerts", json=payload("v2", "2026-12-03T18:00:00Z"), headers=ADMIN).json()
        assert [j["created"] for j in fresh["jobs"]] == [True] and fresh["ignored"] == []
        app.state.gateway.jobs.finish(fresh["jobs"][0]["id"], "failed")
        unlabelled = client.post("/admin/alerts", json=payload(None, "2026-12-03T19:00:00Z"), headers=ADMIN).json()
        assert [j["created"] for j in unlabelled["jobs"]] == [True]
    assert len(JobQueue(Database(settings.database)).list("science")) == 3


def test_capture_is_off_by_default_and_keeps_only_what_the_domain_opted_into(tmp_path):
    app, _, settings = make_app(tmp_path)
    capture = Capture(Database(settings.database))
    with TestClient(app) as client:
        ask(client, "science", "hello")
        assert capture.prompts("science") == []  # off by default
        r = client.put("/admin/capture/science", json={"enabled": True, "max_items": 100}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["include_answers"] is False
        ask(client, "science", "hello Hi")
        ask(client, "medicine", "hello")  # not opted in
        client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "metadata": {"domain": "science"},
                                                  "messages": [{"role": "user", "content": "Hi"}]})
        assert wait_for(lambda: len(capture.prompts("science")) == 2)
        mc, free = capture.prompts("science")
        assert (mc.kind, mc.question, mc.options, mc.answer) == ("multiple_choice", "hello Hi", ("x", "y"), None)
        assert (free.kind, free.question, free.options) == ("free_form", "Hi", None)
        assert capture.prompts("medicine") == []
        assert "hello Hi" not in client.get("/metrics").text

        client.put("/admin/capture/science", json={"enabled": True, "include_answers": True}, headers=ADMIN)
        ask(client, "science", "hello")
        assert wait_for(lambda: len(capture.prompts("science")) == 3)
        assert capture.prompts("science")[-1].answer == "A"
        status = client.get("/admin/capture", headers=ADMIN).json()["data"]
        assert status == [{"domain": "science", "enabled": True, "max_items": 5000, "max_age_s": 604800.0,
                           "include_answers": True, "captured": 3}]
        assert client.delete("/admin/capture/science/prompts", headers=ADMIN).json() == {"domain": "science", "deleted": 3}
        assert capture.prompts("science") == []

        assert client.put("/admin/capture/astrology", json={"enabled": True}, headers=ADMIN).status_code == 404
        for bad in ({}, {"enabled": "yes"}, {"enabled": True, "max_items": 0}, {"enabled": True, "extra": 1}):
            r = client.put("/admin/capture/science", json=bad, headers=ADMIN)
            assert r.status_code == 400, (bad, r.text)


def test_a_corrupt_version_is_refused_at_load_and_the_current_one_keeps_serving(tmp_path):
    """A registry copy damaged after registration (disk fault, a hand edit): the loader's verification refuses it,
    /health says why, and the domain stays on the version it had."""
    app, engines, settings = make_app(tmp_path)
    registry = Registry(Database(settings.database), settings.registry_root)
    registry.add(artifact_copy(tmp_path, "v2"), trigger="operator")
    (registry.path_of("v2") / "alpha_head.safetensors").write_bytes(b"corrupt")
    with TestClient(app) as client:
        assert client.post("/admin/artifacts/v2/promote", json={"domain": "science"}, headers=ADMIN).status_code == 200
        assert wait_for(lambda: "v2" in app.state.gateway.deployments.problems)
        assert "do not match the hash" in client.get("/health", headers=ADMIN).json()["versions"]["problems"]["v2"]
        assert ask(client, "science") == "v1" and "v2" not in engines
