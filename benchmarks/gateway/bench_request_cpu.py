"""The gateway's CPU per request without its HTTP server: the built app (`calm serve`'s, upstream mode, the identity
artifact) driven straight from ASGI, 32 requests at a time, against the instant upstream on the other core.

    python benchmarks/gateway/bench_request_cpu.py [--requests 6000] [--rounds 3] [--cached-answer]

Steadier than wrk at the ceiling on a noisy host (no server, no load generator on the gateway's core): the CPU this
process spent per request (`time.process_time`), per round. `--cached-answer` replaces the upstream call by the answer
it gave first (no HTTP at all), so the difference of the two runs is what the upstream client costs. The same question
in every request, as bench_lean.py's ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gateway.bench_lean import chat_body, upstream_gateway_env  # noqa: E402
from tests.servers import free_port, running  # noqa: E402
from training.artifacts import write_identity_artifact  # noqa: E402

BODY = json.dumps(chat_body("What is the capital of France?")).encode()
HEADERS = [(b"host", b"gateway"), (b"content-type", b"application/json"), (b"authorization", b"Bearer sk-bench"),
           (b"content-length", str(len(BODY)).encode())]
SCOPE = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
         "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
         "headers": HEADERS, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


async def one(app) -> None:
    sent, status = False, []

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Future()  # the client never leaves

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app({**SCOPE, "state": {}}, receive, send)
    if status != [200]:
        raise RuntimeError(f"the gateway answered {status}")


def cache_upstream_answer() -> None:
    from adapters.clients.upstream import UpstreamVLLMEngine
    real, cached = UpstreamVLLMEngine.generate_whole, []

    async def generate_whole(self, request):
        if not cached:
            cached.extend(await real(self, request))
        # Fresh lists per request, as a real answer's (the scorer may keep or change what it is given).
        return [replace(d, token_ids=list(d.token_ids), token_logprobs=list(d.token_logprobs),
                        top_logprobs=[dict(t) for t in d.top_logprobs]) for d in cached]

    UpstreamVLLMEngine.generate_whole = generate_whole


@asynccontextmanager
async def built_gateway(upstream: str, work: Path):
    """`calm serve`'s app (upstream mode, the identity artifact) started in this process and warmed (connections,
    caches), without its HTTP server."""
    identity = work / "identity"
    write_identity_artifact(identity, None, with_reference=False)
    os.environ.update(upstream_gateway_env(upstream, work, "cpu", identity))
    from calm_cli.common import gateway_settings
    from calm_cli.serving import build_gateway
    from gateway.edge.starting import StartingApp

    settings = gateway_settings()
    starting = StartingApp(lambda: build_gateway(settings))
    await starting._start()
    if starting.app is None:
        raise RuntimeError(f"the gateway did not start: {starting.failed}")
    try:
        for _ in range(300):
            await one(starting.app)
        yield starting.app
    finally:
        await starting._lifespan.aclose()


def with_instant_upstream(measure, *args):
    """`measure(upstream, work, *args)` on uvloop, on core 0, the instant upstream on core 1."""
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        argv = ["taskset", "-c", "1", sys.executable, str(REPO / "benchmarks/gateway/instant_upstream.py"), str(port)]
        with running(argv, f"{upstream}/health", work / "instant.log"):
            os.sched_setaffinity(0, {0})
            try:
                return uvloop.run(measure(upstream, work, *args))
            finally:
                os.sched_setaffinity(0, range(os.cpu_count()))


async def measure(upstream: str, work: Path, args) -> list[float]:
    async with built_gateway(upstream, work) as app:
        if args.cached_answer:
            cache_upstream_answer()
            for _ in range(300):
                await one(app)
        slots = asyncio.Semaphore(32)

        async def limited():
            async with slots:
                await one(app)

        per_request = []
        for r in range(args.rounds):
            cpu = time.process_time()
            await asyncio.gather(*(limited() for _ in range(args.requests)))
            per_request.append((time.process_time() - cpu) / args.requests * 1e6)
            print(f"round {r + 1}: {per_request[-1]:.1f} µs of CPU per request", file=sys.stderr, flush=True)
        return per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6000, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cached-answer", action="store_true", help="no upstream call after the first")
    args = parser.parse_args()
    rounds = with_instant_upstream(measure, args)
    print(f"CPU per request (µs), {'cached answer' if args.cached_answer else 'upstream called'}: "
          f"{', '.join(f'{x:.1f}' for x in rounds)}; min {min(rounds):.1f}")


if __name__ == "__main__":
    main()
