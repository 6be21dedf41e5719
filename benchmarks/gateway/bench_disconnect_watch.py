"""What watching for a client's disconnect costs a request (gateway/fast_lane.py): nothing watched, a watcher task per
request (vLLM's `with_cancellation`), and the fast lane's timer that starts a watcher only for a request still running
after WATCH_AFTER_S. The request itself is one await; the receive callable waits as uvicorn's does (an asyncio.Event).

    python benchmarks/gateway/bench_disconnect_watch.py

On uvloop, one core; microseconds per request, median of 5 repeats of 20,000 requests, and each against nothing watched.
The ceiling with the timer, side by side with the commit before it: benchmarks/gateway/bench_ceiling_ab.py.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gateway.fast_lane import WATCH_AFTER_S, DisconnectWatch  # noqa: E402

REQUESTS, REPEATS = 20_000, 5


def receiver():
    event = asyncio.Event()  # uvicorn's RequestResponseCycle.message_event: set on the disconnect

    async def receive():
        await event.wait()
        return {"type": "http.disconnect"}
    return receive


async def handler():
    await asyncio.sleep(0)


async def unwatched(receive):
    await handler()


async def task_per_request(receive):
    async def watch(task):
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch(asyncio.current_task()))
    try:
        await handler()
    finally:
        watcher.cancel()


async def timer(receive):
    watch = DisconnectWatch(receive, asyncio.current_task(), WATCH_AFTER_S)
    try:
        await handler()
    finally:
        watch.stop()


async def per_request_us(kind) -> float:
    loop, receive = asyncio.get_running_loop(), receiver()
    start = time.perf_counter()
    for _ in range(REQUESTS):
        await loop.create_task(kind(receive))  # each request is a task of its own, as uvicorn runs it
    return (time.perf_counter() - start) / REQUESTS * 1e6


async def main() -> None:
    kinds = (unwatched, task_per_request, timer)
    runs = {k.__name__: [] for k in kinds}
    for _ in range(REPEATS):
        for kind in kinds:  # interleaved, so drift of the machine hits all alike
            runs[kind.__name__].append(await per_request_us(kind))
    base = statistics.median(runs["unwatched"])
    print("| watch | µs per request | over nothing watched |\n|---|---:|---:|")
    for name, values in runs.items():
        us = statistics.median(values)
        print(f"| {name.replace('_', ' ')} | {us:.1f} | +{us - base:.1f} µs |")


if __name__ == "__main__":
    uvloop.run(main())
