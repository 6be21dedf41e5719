"""The OpenAPI document states what the gateway does (fast, the gateway's own logic behind a fake engine; the real
engine is fuzzed in tests/test_fuzz.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest

from gateway.protocol.common import WHITE_SPACE
from tests.servers import free_port, http as shared_http
from tests.test_client_keys import make_app


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    return make_app(tmp_path_factory.mktemp("contract"), max_tokens_limit=64).openapi()


def test_invalid_requests_are_documented_as_400s_in_the_openai_error_shape(document):
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if operation.get("parameters") or operation.get("requestBody"):
                assert "400" in responses, (method, path)
                assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_request_rules_are_in_the_schema(document):
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["properties"]["messages"]["contains"]["properties"]["role"] == {"const": "user"}
    assert {"type": "integer", "minimum": 1, "maximum": 64} in chat["properties"]["max_tokens"]["anyOf"]
    assert any(rule["if"]["required"] == ["top_logprobs"] for rule in chat["allOf"])
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    nonblank = re.compile(prompt[0]["pattern"])  # some character that is not Unicode white space, spelled out
    assert not any(nonblank.search(c) for c in WHITE_SPACE) and all(nonblank.search(c) for c in "x\x1c\u200b")
    assert prompt[1]["maxItems"] == 64
    assert len(schemas["Policy"]["oneOf"]) == 2
    put = document["paths"]["/admin/policies/{domain}"]["put"]
    assert put["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/Policy")
    domain = next(p for p in put["parameters"] if p["name"] == "domain")
    assert domain["schema"]["pattern"].startswith("^[a-z0-9]")
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def test_a_405_names_every_method_of_the_path_and_every_error_code_is_a_string(tmp_path):
    """`code` was the HTTP status (an integer) where no specific code applied and a string elsewhere (65)."""
    from fastapi.testclient import TestClient

    with TestClient(make_app(tmp_path)) as http:
        r = http.put("/admin/keys")
        assert r.status_code == 405 and r.headers["Allow"] == "GET, POST" and r.json()["error"]["code"] == "method_not_allowed"
        codes = {r.status_code: r.json()["error"]["code"] for r in (
            http.get("/v1/nowhere"), http.post("/v1/chat/completions", json={"model": "m"}),
            http.get("/admin/keys"), http.put("/admin/keys"))}
        assert codes == {404: "not_found", 400: "bad_request", 401: "unauthorized", 405: "method_not_allowed"}


def test_schemathesis_finds_no_contract_violation_behind_a_fake_engine(tmp_path):
    """Every check, schema-valid acceptance included; fast enough for every run."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", (
        "import sys, pathlib, uvicorn; sys.path.insert(0, '.'); from tests.test_client_keys import make_app; "
        f"uvicorn.run(make_app(pathlib.Path({str(tmp_path)!r})), host='127.0.0.1', port={port}, log_level='warning')")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180  # importing the app takes seconds, many more on a busy machine
        while True:
            try:
                shared_http.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5)
                break
            except httpx.HTTPError:
                assert server.poll() is None and time.monotonic() < deadline, "the app under test did not start"
                time.sleep(0.1)
        from tests.test_fuzz import CHECKS

        done = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", f"http://127.0.0.1:{port}/openapi.json",
                               "--checks", CHECKS, "--max-examples", "40", "--seed", "7", "--workers", "1",
                               "-H", "Authorization: Bearer dev-admin-key"], capture_output=True, text=True, timeout=600)
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[0]
    assert done.returncode == 0, done.stdout[-5000:]
    assert "Traceback" not in log, log[-3000:]


def test_several_free_form_answers_need_a_temperature_in_the_schema_as_in_the_gateway(document, tmp_path):
    """Omitted, the temperature is 0 here (greedy): n > 1 free-form answers are refused naming `n`, and the document
    says so, so a schema-valid request is never refused (multiple choice draws n options, greedily or not)."""
    import jsonschema
    from fastapi.testclient import TestClient

    for name in ("ChatCompletionRequest", "CompletionRequest"):
        rules = jsonschema.Draft202012Validator({"allOf": document["components"]["schemas"][name]["allOf"]})
        assert not rules.is_valid({"n": 2}) and not rules.is_valid({"n": 2, "temperature": 0})
        assert all(rules.is_valid(body) for body in ({"n": 2, "temperature": 0.7}, {"n": 1}, {"n": 2, "options": ["a", "b"]}))
    with TestClient(make_app(tmp_path)) as http:
        r = http.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert "set a temperature above 0" in r.json()["error"]["message"]
