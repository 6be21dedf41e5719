"""The upstream adapter: a gateway in front of a separate vLLM OpenAI server started by `calm engine` (with a dead
upstream listed first: requests fail over to the live one), and only dead upstreams answering 503 quickly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.servers import calm_argv, free_port, http, metric_values, running, wait_until

pytestmark = pytest.mark.slow
MODEL = "calm-smollm2-135m"
QUESTION = {"messages": [{"role": "user", "content": "Which planet is largest?"}],
            "options": ["Mars", "Jupiter", "Venus", "Mercury"], "metadata": {"domain": "science"}}


def chat(base: str, **body) -> httpx.Response:
    return http.post(f"{base}/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)


def test_dead_upstream_returns_503_quickly(tmp_path, embedded_model_dir):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    port = free_port()
    env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": f'["{dead}"]', "CALM_DB_PATH": str(tmp_path / "g.db")}
    # /v1/models needs no engine, so it tells when the gateway is up even though /health must fail.
    with running(calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/v1/models", tmp_path / "gw.log",
                 env) as gateway:
        base = f"http://127.0.0.1:{port}"
        for body in (QUESTION, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}):
            start = time.monotonic()
            r = chat(base, **body)
            # A refused connection is answered at once; 10 s is far under the 30 s read timeout a waiting request hits.
            assert time.monotonic() - start < 10
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        stream = http.post(f"{base}/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 4,
                                                                  "messages": [{"role": "user", "content": "hi"}]})
        assert '"service_unavailable_error"' in stream.text and stream.text.rstrip().endswith("data: [DONE]")
        assert http.get(f"{base}/health").status_code == 503
        metrics = http.get(f"{base}/metrics").text
        assert 'calm_requests_total{domain="science",endpoint="chat",status="503"} 1.0' in metrics
        # Its engines are elsewhere: nothing it ran loaded torch or scikit-learn (AutoTokenizer's import would: ~3.5 CPU
        # s and ~0.3 GB per replica; calm_core/models.py model_tokenizer).
        libraries = Path(f"/proc/{gateway.pid}/maps").read_text()
        assert "libtorch" not in libraries and "sklearn" not in libraries


def test_gateway_over_calm_engine_matches_hf(tmp_path, shipped_artifact, shipped_model):
    """`calm engine` serves vLLM with the shipped artifact (merged LoRA + α head); through it the gateway gives the
    cloze option probabilities HF + peft give (fp32, 1e-3), the prompt travelling as token ids over HTTP."""
    import numpy as np

    from tests.hf_reference import cloze_option_probs

    model, tokenizer = shipped_model
    head = shipped_artifact.head
    question = QUESTION["messages"][0]["content"]
    expected = cloze_option_probs(model, tokenizer, question, QUESTION["options"], head.scale, head.shift)
    raw = cloze_option_probs(model, tokenizer, question, QUESTION["options"])
    engine_port, gw_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    dead = f"http://127.0.0.1:{free_port()}"  # listed first: every request that lands on it fails over to the live one
    # The engine resolves the versions the gateway names in the gateway's registry folder (a shared volume on a fleet).
    registry = {"CALM_REGISTRY_DIR": str(tmp_path / "registry")}
    env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": f'["{dead}", "{engine_url}"]',
           "CALM_DB_PATH": str(tmp_path / "g.db"), "VLLM_CPU_KVCACHE_SPACE": "1", **registry}
    with running(calm_argv("engine", "--port", str(engine_port)), f"{engine_url}/health", tmp_path / "engine.log",
                 registry, timeout=300) as engine, \
         running(calm_argv("serve", "--port", str(gw_port)), f"http://127.0.0.1:{gw_port}/health", tmp_path / "gw.log", env):
        base = f"http://127.0.0.1:{gw_port}"
        # `calm engine` runs on tcmalloc (scripts/test.sh installs it; adapters/hosting/allocator.py), and says so
        assert "libtcmalloc_minimal" in Path(f"/proc/{engine.pid}/maps").read_text()
        started = (tmp_path / "engine.log").read_text()
        assert "allocator: libtcmalloc_minimal.so.4 (preloaded)" in started
        assert "--block-size 32" in started  # a fleet engine on CPU: blocks the questions fill (FLEET_CPU_BLOCK_SIZE)
        r = chat(base, **QUESTION)
        assert r.status_code == 200, r.text
        cal = r.json()["choices"][0]["calibration"]
        assert cal["mode"] == "multiple_choice" and cal["raw_confidence"] is not None
        chosen = "ABCD".index(r.json()["choices"][0]["message"]["content"])
        np.testing.assert_allclose([o["probability"] for o in cal["options"]], expected, atol=1e-3)
        assert cal["raw_confidence"] == pytest.approx(raw[chosen], abs=1e-3)
        free = chat(base, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=10)
        assert free.status_code == 200 and "Paris" in free.json()["choices"][0]["message"]["content"]
        free_form_path = http.get(f"{base}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["scoring"]["free_form"]  # as this engine serves it
        assert "as a vLLM LoRA loaded at run time" in free_form_path and "no raw confidence" in free_form_path
        lines = http.post(f"{base}/v1/chat/completions", json={"model": MODEL, "stream": True, "max_tokens": 6,
                           "messages": [{"role": "user", "content": "Count: one, two,"}]}).text.strip().split("\n\n")
        assert lines[-1] == "data: [DONE]" and '"calibration"' in lines[-2]

        given_up_on_is_aborted(base, engine_url)

        # The engine is a stock vLLM server with the α-head plugin: a request may name a version of the registry by
        # name (here the engine's own), never a path.
        def direct(head: str) -> httpx.Response:
            return http.post(f"{engine_url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "The sky is", "max_tokens": 1, "vllm_xargs": {"calm_head": head}})

        assert direct(shipped_artifact.manifest.artifact_version).status_code == 200
        for bad in ("/etc", f"../{shipped_artifact.path.name}", "no-such-version"):
            refused = direct(bad)
            assert refused.status_code == 400 and "calm_head" in refused.text, (bad, refused.text)

        # A gateway whose registry the engine cannot see refuses to start, naming the setting to fix (rather than
        # answering every request with the engine's refusal). Its identity version has no adapter, so the engine
        # refuses the head inside its stream (after a 200), the path a version with an adapter never takes.
        from training.artifacts import write_identity_artifact

        write_identity_artifact(tmp_path / "identity", with_reference=False)
        stray = subprocess.run(calm_argv("serve", "--port", str(free_port())), capture_output=True, text=True,
                               timeout=300, env={**os.environ, **env, "CALM_REGISTRY_DIR": str(tmp_path / "elsewhere"),
                                                 "CALM_ARTIFACT": str(tmp_path / "identity"),
                                                 "CALM_DB_PATH": str(tmp_path / "stray.db")})
        assert stray.returncode != 0 and "CALM_REGISTRY_DIR" in stray.stderr + stray.stdout, stray.stderr[-2000:]

        # An engine killed under load (503s for requests in flight, none hangs, served again once an engine is back
        # on its port): tests/test_fleet.py (c), with two engines and the restarted one alone serving at the end; all
        # upstreams down answered with a quick 503: test_dead_upstream_returns_503_quickly above.


def given_up_on_is_aborted(base: str, engine_url: str) -> None:
    """A client that disconnects from a non-streamed request while the engine generates its answer: the engine stops
    (no request left running, none finished with a stop or length reason: vLLM counts no aborted request there) and
    the gateway counts a 499."""
    finished = sum(metric_values(engine_url, "vllm:request_success_total"))
    body = json.dumps({"model": MODEL, "max_tokens": 1000, "metadata": {"domain": "science"},
                       "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until("the engine to start the request",
                   lambda: sum(metric_values(engine_url, "vllm:num_requests_running")) >= 1, 120, 0.05)
    # Without the cancellation a thousand tokens take the engine over 120 s here: the wait would end in a failure.
    wait_until("the engine to stop generating for a client that had gone",
               lambda: sum(metric_values(engine_url, "vllm:num_requests_running")) == 0, 120, 0.05)
    assert sum(metric_values(engine_url, "vllm:request_success_total")) == finished
    assert metric_values(base, "calm_requests_total", domain="science", endpoint="chat", status="499") == [1.0]


def answer_text(streamed: bool) -> str:
    """vLLM's answer to a completion request, whole or as SSE (its usage in a chunk of its own)."""
    choice = {"index": 0, "text": "Paris", "finish_reason": "stop",
              "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5], "top_logprobs": [{"token_id:7": -0.5}]}}
    usage = {"prompt_tokens": 3, "completion_tokens": 1}
    if not streamed:
        return json.dumps({"choices": [choice], "usage": usage})
    return f"data: {json.dumps({'choices': [choice]})}\n\ndata: {json.dumps({'choices': [], 'usage': usage})}\n\n" \
           "data: [DONE]\n\n"


async def listening(app, port: int):
    """An aiohttp app served on 127.0.0.1:`port`; its runner, to clean up."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_failover_marks_a_failing_upstream_down_and_asks_the_next(embedded_model_dir):
    """The failover logic over real sockets: a refused connection or a 5xx moves the request to the next upstream
    before any output; the failed one is asked last for a while; all failing is a 503 naming each."""
    import asyncio

    from aiohttp import web

    from calm_core.engine import EngineOutput, EngineRequest, EngineUnavailable, generate
    from adapters.clients.upstream import UpstreamVLLMEngine

    seen = []

    def server(name: str, status: int):
        async def completions(request: web.Request) -> web.Response:
            seen.append(name)
            if status != 200:
                return web.Response(status=status, text="boom")
            streamed = (await request.json()).get("stream", False)
            return web.Response(text=answer_text(streamed),
                                content_type="text/event-stream" if streamed else "application/json")
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        return app

    async def run(names):
        runners, urls = [], []
        for name in names:
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            if name == "down":
                continue  # nothing listens there: connection refused
            runners.append(await listening(server(name, 500 if name == "broken" else 200), port))
        engine = UpstreamVLLMEngine(urls, MODEL, "v", 2048)
        await engine.start()
        try:
            whole = [await generate(engine, EngineRequest(request_id=str(i), prompt="q")) for i in range(2)]
            streamed = [EngineOutput.collect([d async for d in engine.stream(EngineRequest(str(i), prompt="q"))])
                        for i in range(2, 4)]
            return whole + streamed
        finally:
            await engine.close()
            for runner in runners:
                await runner.cleanup()

    outs = asyncio.run(run(["down", "broken", "live"]))
    assert [(o.text, o.token_ids, o.finish_reason, o.prompt_tokens) for o in outs] == [("Paris", [7], "stop", 3)] * 4
    assert seen == ["broken", "live", "live", "live", "live"]  # down refused; the failed ones are asked last
    seen.clear()
    with pytest.raises(EngineUnavailable, match="unreachable.*HTTP 500"):
        asyncio.run(run(["down", "broken"]))


@pytest.mark.parametrize("how", ["closed", "reset"])
def test_a_connection_closed_before_any_answer_is_asked_again_on_a_fresh_one(how):
    """With one balancer URL there is no next upstream: a request whose connection is closed or reset before any
    answer (a kept-alive connection the balancer or the engine's server had just closed as idle: vLLM's uvicorn does
    after 5 s) is sent once more, on a new connection, and answered."""
    import asyncio
    import struct

    from calm_core.engine import EngineRequest, generate
    from adapters.clients.upstream import UpstreamVLLMEngine

    body = answer_text(streamed=False).encode()
    connections = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        connections.append(writer)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        if len(connections) > 1:  # the first connection is closed without an answer
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
        elif how == "reset":  # an RST, not a FIN: the client reads "connection reset by peer"
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()

    async def run():
        port = free_port()
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        engine = UpstreamVLLMEngine([f"http://127.0.0.1:{port}"], MODEL, "v", 2048)
        await engine.start()
        try:
            return await generate(engine, EngineRequest(request_id="r", prompt="q"))
        finally:
            await engine.close()
            server.close()

    assert asyncio.run(run()).text == "Paris" and len(connections) == 2


def test_a_whole_answer_is_awaited_as_a_whole_and_a_stream_chunk_by_chunk():
    """An answer asked for whole arrives after its last token, so it is bounded by the answer timeout (the gateway's
    request deadline), not by the wait for each chunk of a stream: an engine that takes longer than a chunk's wait
    to answer whole is not taken for a hung one, while the same wait before a stream's first chunk is a timeout."""
    import asyncio

    from aiohttp import web

    from calm_core.engine import EngineRequest, EngineUnavailable, generate
    from adapters.clients.upstream import UpstreamVLLMEngine

    async def completions(request: web.Request) -> web.Response:
        streamed = (await request.json()).get("stream", False)
        await asyncio.sleep(1.0)  # five times the chunk wait below
        return web.Response(text=answer_text(streamed), content_type="application/json")

    async def run(stream: bool):
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        port = free_port()
        runner = await listening(app, port)
        engine = UpstreamVLLMEngine([f"http://127.0.0.1:{port}"], MODEL, "v", 2048, timeout_s=0.2, answer_timeout_s=30)
        await engine.start()
        try:
            request = EngineRequest("r", prompt="q")
            return [d async for d in engine.stream(request)] if stream else await generate(engine, request)
        finally:
            await engine.close()
            await runner.cleanup()

    assert asyncio.run(run(stream=False)).text == "Paris"
    with pytest.raises(EngineUnavailable, match="timed out"):
        asyncio.run(run(stream=True))


def test_every_sampling_parameter_is_sent_so_a_servers_generation_config_never_fills_one():
    """A stock `vllm serve` fills a parameter a request leaves out from the model's generation_config.json (Qwen2.5's
    repetition penalty 1.05, top-k 20): the read-back of a free-form answer must reach the engine with vLLM's "off"
    values, so they are always sent (n only where it is not 1)."""
    from adapters.clients.upstream import _payload
    from calm_core.engine import EngineRequest

    body = _payload("m", "v1", EngineRequest("r", prompt="", prompt_token_ids=(1, 2), max_tokens=1, top_logprobs=5))
    assert {k: body[k] for k in ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")} == {
        "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    assert "n" not in body and body["temperature"] == 0.0
