"""Group commit: rows from concurrent requests written in one transaction, off the event loop.

A response is acknowledged only once its rows are stored (nothing acknowledged may be lost), so each request awaits a
commit; one transaction per request, each with its own thread hop, was about a tenth of the gateway's busy time at its
ceiling (benchmarks/gateway/bench_lean.py --profile). Here the first caller starts a writer; whatever arrives while a
transaction is in progress goes into the next one, so a burst of N requests costs a few transactions, and a lone
request still costs exactly one, with no added wait.

A request alone in the gateway (concurrency 1) writes on the event loop instead, where SQLite's lock is free at once
(`write_at_once`): nothing else waits on the loop then, and the hop to a thread and back cost more than the write and
ran beside the request's next upstream call (benchmarks/gateway/bench_request_stages.py). That was measured with SQLite's
synchronous=NORMAL (no fsync per commit); since synchronous=FULL (calm_core/db.py: an acknowledged write survives a
power loss) each commit also fsyncs the WAL, on the loop in this path, not measured yet. With company, a write on the
loop would stall the others and end group commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

Row = TypeVar("Row")


class GroupCommit(Generic[Row]):
    def __init__(self, write: Callable[[list[Row]], object],
                 write_at_once: Callable[[Sequence[Row]], bool] | None = None, alone: Callable[[], bool] = lambda: False):
        self._write = write  # blocking: one transaction for all the rows given
        self._write_at_once = write_at_once  # brief: False, nothing written, where it would have to wait
        self._alone = alone  # no other request in flight
        self._pending: list[tuple[Sequence[Row], asyncio.Future]] = []
        self._writer: asyncio.Task | None = None

    async def add(self, rows: Sequence[Row]) -> None:
        """Returns once `rows` are committed; raises what the write raised (the whole batch failed with it)."""
        idle = self._writer is None or self._writer.done()
        if idle and self._write_at_once is not None and self._alone() and self._write_at_once(rows):
            return
        future = asyncio.get_running_loop().create_future()
        self._pending.append((rows, future))
        if idle:
            self._writer = asyncio.get_running_loop().create_task(self._drain())
        # Shielded: a caller that gives up (deadline, disconnect) must not cancel the others' commit.
        await asyncio.shield(future)

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self._write, [row for rows, _ in batch for row in rows])
            except Exception as e:  # noqa: BLE001  (handed to every caller of the batch)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
            else:
                for _, future in batch:
                    if not future.done():
                        future.set_result(None)
