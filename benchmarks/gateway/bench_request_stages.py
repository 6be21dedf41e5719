"""Where a request's wall time goes at concurrency 1: the built app (`calm serve`'s, upstream mode, the identity
artifact) driven straight from ASGI, one request at a time, against the instant upstream on the other core; each
stage timed by a wrapper around the function that does it.

    python benchmarks/gateway/bench_request_stages.py [--requests 3000] [--without-record]

Concurrency 1 is where the gateway's added latency in front of an engine is measured (bench_added_latency.py): there a
request's waits (the upstream hop, the record's commit in a worker thread) count in full, where at the ceiling they
overlap with other requests. A bare POST of the same engine request with a fresh aiohttp session's pool (no gateway)
gives what the hop to the upstream costs by itself (timed after the stages: its aiohttp calls are wrapped too).
Median microseconds per stage, nested stages indented; each wrapper adds ~1 µs. `--without-record` stores nothing (the
record a no-op: not the product, a measure of what its worker thread costs the other stages).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gateway.bench_request_cpu import built_gateway, one, with_instant_upstream  # noqa: E402

STAGES: dict[str, list[int]] = {}


def timed(owner, name: str, stage: str) -> None:
    """Replace `owner.name` by a wrapper that adds each call's wall time (ns) to STAGES[stage]."""
    real = getattr(owner, name)
    if inspect.iscoroutinefunction(real):
        @functools.wraps(real)
        async def wrapper(*args, **kwargs):
            started = time.perf_counter_ns()
            try:
                return await real(*args, **kwargs)
            finally:
                STAGES.setdefault(stage, []).append(time.perf_counter_ns() - started)
    else:
        @functools.wraps(real)
        def wrapper(*args, **kwargs):
            started = time.perf_counter_ns()
            try:
                return real(*args, **kwargs)
            finally:
                STAGES.setdefault(stage, []).append(time.perf_counter_ns() - started)
    setattr(owner, name, wrapper)


def instrument() -> list[tuple[str, int]]:
    """Wrap the functions of the stages; returns (stage, depth) as they nest."""
    import aiohttp

    import gateway.fast_lane as fast_lane
    from adapters.clients.upstream import UpstreamVLLMEngine
    from gateway.serving.service import CalibratedService
    from gateway.records.store import Store

    wrapped = [(fast_lane, "answer", "route: prepare, answer, response object", 1),
               (CalibratedService, "answer", "service.answer", 2),
               (UpstreamVLLMEngine, "generate_whole", "upstream call (aiohttp, instant upstream)", 3),
               (aiohttp.ClientSession, "_request", "sent, until the response's headers", 4),
               (aiohttp.ClientResponse, "read", "the body read", 4),
               (CalibratedService, "calibrate", "calibrate", 3),
               (CalibratedService, "record", "record (group commit, awaited)", 3),
               (Store, "record_responses", "the write itself (on the loop alone, else in the thread)", 4)]
    for owner, name, stage, _ in wrapped:
        timed(owner, name, stage)
    return [("request (ASGI call)", 0)] + [(stage, depth) for *_, stage, depth in wrapped]


async def measure(upstream: str, work: Path, requests: int, without_record: bool) -> dict:
    import aiohttp

    from adapters.clients.upstream import _payload
    from calm_core.engine import EngineRequest
    from gateway.serving.service import CalibratedService

    if without_record:
        async def record(self, served, ctx) -> None:
            return None

        CalibratedService.record = record
    order = instrument()
    async with built_gateway(upstream, work) as app:
        STAGES.clear()
        for _ in range(requests):
            started = time.perf_counter_ns()
            await one(app)
            STAGES.setdefault("request (ASGI call)", []).append(time.perf_counter_ns() - started)
        medians = {stage: statistics.median(STAGES[stage]) / 1000 for stage, _ in order if stage in STAGES}
        payload = _payload("calm", None, EngineRequest("bench", prompt="What is the capital of France?", max_tokens=16,
                                                       temperature=0.0, top_logprobs=5), stream=False)
        async with aiohttp.ClientSession() as session:
            bare = []
            for i in range(requests + 300):
                started = time.perf_counter_ns()
                async with session.post(f"{upstream}/v1/completions", json=payload) as resp:
                    await resp.read()
                if i >= 300:
                    bare.append(time.perf_counter_ns() - started)
    return {"stages": [(stage, depth, medians[stage]) for stage, depth in order if stage in medians],
            "bare_hop_us": statistics.median(bare) / 1000, "requests": requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--without-record", action="store_true", help="store nothing (not the product: a measure)")
    args = parser.parse_args()
    result = with_instant_upstream(measure, args.requests, args.without_record)
    print(f"{result['requests']} requests one at a time; median µs per stage:")
    for stage, depth, us in result["stages"]:
        print(f"{'  ' * depth}{stage}: {us:.0f}")
    print(f"a bare aiohttp POST of an engine request to the instant upstream: {result['bare_hop_us']:.0f}")


if __name__ == "__main__":
    main()
