"""State read from the store and kept in memory on the request path: policies, client keys, capture settings."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger("calm.gateway")


class CachedRead(Generic[T]):
    """`read()`'s value, served from memory and read again once older than `max_age_s`, so a change made through
    another replica sharing the database is in force here within that time and one read; `refresh()` reads at once
    (start-up, this replica's own writes, from a thread). On the event loop a stale value is served while a thread
    reads the store, one read at a time: a slow or partitioned database never holds the loop, and a read that fails
    leaves the last value in force (logged) until one succeeds."""

    def __init__(self, read: Callable[[], T], max_age_s: float, clock=time.monotonic):
        self._read, self.max_age_s, self.clock = read, max_age_s, clock
        self._loaded = float("-inf")
        self._reading = False

    def refresh(self) -> T:
        value = self._read()
        self._value, self._loaded = value, self.clock()
        return value

    def get(self) -> T:
        if self.clock() - self._loaded <= self.max_age_s:
            return self._value
        if self._loaded == float("-inf"):
            return self.refresh()  # nothing read yet: nothing to serve meanwhile
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self.refresh()  # off the event loop (a worker thread, the CLI): reading here blocks nobody
        if not self._reading:
            self._reading = True
            loop.run_in_executor(None, self._refresh_quietly)
        return self._value

    def _refresh_quietly(self) -> None:
        try:
            self.refresh()
        except Exception as e:  # the store is down: the last value stays in force, the next get() tries again
            log.warning("could not refresh %s from the store: %s", type(self).__name__, e)
        finally:
            self._reading = False
