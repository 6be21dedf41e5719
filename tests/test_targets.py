"""Escalation targets and review webhooks are the operator's (63, item 2): an admin's policy names one of the targets
in CALM_TARGETS and can add no URL, key source or protocol; a policy stored with a URL before keeps working only
towards a URL the operator lists, with the operator's key; private and link-local addresses only where allowed."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from gateway.serving.escalation import Escalator, TargetFailed
from gateway.policy.policies import EscalationTarget
from gateway.protocol.openai import ChatCompletionRequest
from gateway.policy.targets import Target, Targets, address_allowed
from tests.test_escalation_logic import ADMIN, QUESTION, TARGET, TARGETS, answering_b, gateway_app


def test_an_admin_names_only_the_operators_targets(tmp_path):
    from fastapi.testclient import TestClient

    with TestClient(gateway_app(tmp_path, lambda request: httpx.Response(500))) as client:
        def refused(escalate=None, review=None):
            policy = {"threshold": 0.8, "action": "escalate" if escalate else "review",
                      **({"escalate": escalate} if escalate else {}), **({"review": review} if review else {})}
            r = client.put("/admin/policies/science", json=policy, headers=ADMIN)
            assert r.status_code == 400, r.text
            return r.json()["error"]

        for own in ({"url": "http://collector.example/v1"}, {"api_key_env": "CALM_DB_URL"},
                    {"api_key_file": "/var/run/secrets/kubernetes.io/serviceaccount/token"}, {"protocol": "calm"}):
            error = refused(escalate={**TARGET, **own})
            assert "the operator's" in error["message"] and error["param"].startswith("escalate"), error
        error = refused(escalate={**TARGET, "target": "collector"})
        assert error["param"] == "escalate.target"
        assert "'collector' is not one of the operator's escalate targets (CALM_TARGETS: strong, strong-calm)" in (
            error["message"])
        assert "the operator's" in refused(review={"webhook": "http://169.254.169.254/latest"})["message"]
        assert refused(review={"webhook": "pager"})["param"] == "review.webhook"
        assert client.get("/admin/policies/science", headers=ADMIN).status_code == 404  # nothing was stored


def test_a_policy_stored_with_a_url_is_kept_and_calls_only_a_url_the_operator_lists(tmp_path, monkeypatch):
    """Policies written before targets were named hold a URL and a key source of the admin's choosing. They still load
    and show (nothing stored is lost); a URL the operator also lists is called with the operator's key, any other is
    never called and the policy's on_failure applies."""
    from fastapi.testclient import TestClient

    seen = []
    target = answering_b(seen)

    monkeypatch.setenv("STRONG_KEY", "operators-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    with TestClient(gateway_app(tmp_path, target)) as client:
        gateway = client.app.state.gateway
        listed = {"threshold": 0.8, "action": "escalate", "escalate": {
            "url": "http://strong.example/v1/", "model": "strong", "api_key_env": "AWS_SECRET_ACCESS_KEY", "timeout_s": 5.0}}
        gateway.store.put_policy("science", listed, "admin", None)
        gateway.shared.policies.refresh()
        shown = client.get("/admin/policies/science", headers=ADMIN).json()
        assert shown["policy"]["escalate"]["legacy_url"] == "http://strong.example/v1/"
        choice = client.post("/v1/chat/completions", json=QUESTION).json()["choices"][0]
        assert choice["calibration"]["escalated"] and choice["message"]["content"] == "B"
        assert str(seen[-1].url) == "http://strong.example/v1/chat/completions"
        assert seen[-1].headers["authorization"] == "Bearer operators-key"  # never the admin-named variable
        unlisted = {**listed, "escalate": {**listed["escalate"], "url": "http://collector.example/v1"},
                    "review": None, "message": "Ask a person."}
        unlisted["escalate"]["on_failure"] = "abstain"
        gateway.store.put_policy("science", unlisted, "admin", None)
        gateway.shared.policies.refresh()
        calls = len(seen)
        choice = client.post("/v1/chat/completions", json=QUESTION).json()["choices"][0]
        assert len(seen) == calls and choice["message"]["content"] == "Ask a person."
        assert choice["calibration"]["escalation"]["fallback"] == (
            "target: the target is not one the operator named; answer withheld")
        assert client.get("/admin/policies", headers=ADMIN).status_code == 200


@pytest.mark.parametrize("address, public_only, with_private", [
    ("93.184.215.14", True, True), ("2606:4700::1111", True, True),
    ("127.0.0.1", False, True), ("::1", False, True), ("10.1.2.3", False, True), ("192.168.0.7", False, True),
    ("172.16.5.5", False, True), ("fd00::5", False, True), ("169.254.169.254", False, True),  # cloud metadata
    ("fe80::1%eth0", False, True), ("::ffff:127.0.0.1", False, True), ("::ffff:169.254.169.254", False, True),
    ("0.0.0.0", False, False), ("::", False, False), ("224.0.0.251", False, False), ("240.0.0.1", False, False),
    ("2002:a9fe:a9fe::1", False, True), ("2002:0808:0808::1", True, True),  # 6to4 around 169.254.169.254 / 8.8.8.8
    ("fec0::1", False, True),  # site-local
])
def test_which_addresses_a_target_may_reach(address, public_only, with_private):
    assert address_allowed(address, private=False) is public_only
    assert address_allowed(address, private=True) is with_private


class _Answering(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"choices": [{"index": 0, "message": {"content": "Paris"}, "finish_reason": "stop"}],
                           "usage": {"completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_loopback_target_is_called_only_when_the_operator_marks_it_private():
    """Through the gateway's real HTTP client and transport, to a real server on this host."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://localhost:{server.server_address[1]}/v1"
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Capital?"}]})
    policy = EscalationTarget.model_validate({"target": "here", "model": "m", "timeout_s": 10.0})

    async def ask(private: bool):
        escalator = Escalator(targets=Targets({"here": Target(url=url, private=private)}))
        try:
            return await escalator.ask(policy, req, 1, None)
        finally:
            await escalator.close()

    try:
        with pytest.raises(TargetFailed) as refused:
            asyncio.run(ask(private=False))
        assert refused.value.reason == "address" and "127.0.0.1" in refused.value.detail
        assert refused.value.public == "the target's address is not one this gateway may call"
        assert [a.text for a in asyncio.run(ask(private=True))] == ["Paris"]
    finally:
        server.shutdown()


def test_target_names_in_settings_are_checked():
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    assert GatewaySettings(targets=TARGETS).targets["strong"].api_key_env == "STRONG_KEY"
    with pytest.raises(ValidationError, match="target names"):
        GatewaySettings(targets={"a/b": {"url": "http://x.example/v1"}})
    with pytest.raises(ValidationError, match="not both"):
        GatewaySettings(targets={"t": {"url": "http://x.example/v1", "api_key_env": "K", "api_key_file": "/k"}})


def test_a_target_serves_only_the_use_the_operator_gave_it(tmp_path):
    """An escalation target gets callers' whole requests, a webhook review texts: an admin could once point either at
    the other (found in review), sending prompts to the webhook's server or reviews to the provider with its key."""
    from fastapi.testclient import TestClient

    targets = {**TARGETS, "ops-hook": {"url": "http://ops.example/hook", "kind": "webhook"}}
    with TestClient(gateway_app(tmp_path, lambda request: httpx.Response(500), targets=targets)) as client:
        crossed = [{"threshold": 0.8, "action": "escalate", "escalate": {**TARGET, "target": "ops-hook"}},
                   {"threshold": 0.8, "action": "review", "review": {"webhook": "strong"}}]
        for policy in crossed:
            r = client.put("/admin/policies/science", json=policy, headers=ADMIN)
            assert r.status_code == 400 and "is not one of the operator's" in r.json()["error"]["message"], r.text
        assert client.put("/admin/policies/science", json={"threshold": 0.8, "action": "review", "review": {
            "webhook": "ops-hook"}}, headers=ADMIN).status_code == 200
    assert Targets({"t": Target(url="http://x/v1")}).find("t", kind="webhook") is None


def test_an_admin_cannot_write_a_legacy_url_in_any_form():
    from pydantic import ValidationError

    from gateway.policy.policies import Policy

    for review in ({"legacy_url": None}, {"legacy_url": ""}, {"webhook": "ops-hook", "legacy_url": "http://x/h"}):
        with pytest.raises(ValidationError, match="operator's"):
            Policy.model_validate({"threshold": 0.5, "action": "review", "review": review})
    with pytest.raises(ValidationError, match="operator's"):
        Policy.model_validate({"threshold": 0.5, "action": "escalate", "escalate": {**TARGET, "legacy_url": None}})


class _Proxy(BaseHTTPRequestHandler):
    """An HTTP forward proxy that answers every request itself, recording the absolute URL it was asked for."""
    asked: list[str] = []

    def do_POST(self):  # noqa: N802
        type(self).asked.append(self.path)
        _Answering.do_POST(self)

    def log_message(self, *args):
        pass


def test_targets_are_reached_through_the_environments_proxy(monkeypatch):
    """httpx ignores HTTP(S)_PROXY once a client has its own transport, so the address-checking transport made every
    target unreachable behind an egress proxy (found in review). Through the proxy a name is the proxy's to resolve;
    a host written as a private address is still refused, and NO_PROXY hosts are called directly."""
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
    monkeypatch.setenv("NO_PROXY", "direct.invalid")
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Capital?"}]})
    policy = EscalationTarget.model_validate({"target": "t", "model": "m", "timeout_s": 10.0})

    async def ask(url: str):
        escalator = Escalator(targets=Targets({"t": Target(url=url)}))
        try:
            return await escalator.ask(policy, req, 1, None)
        finally:
            await escalator.close()

    try:
        assert [a.text for a in asyncio.run(ask("http://strong.invalid/v1"))] == ["Paris"]
        assert _Proxy.asked == ["http://strong.invalid/v1/chat/completions"]
        for url, reason in (("http://169.254.169.254/v1", "address"), ("http://direct.invalid/v1", "connect")):
            with pytest.raises(TargetFailed) as failed:
                asyncio.run(ask(url))
            assert failed.value.reason == reason and len(_Proxy.asked) == 1
    finally:
        proxy.shutdown()
