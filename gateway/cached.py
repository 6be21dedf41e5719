"""State read from the store and kept in memory on the request path: policies, client keys, capture settings."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CachedRead(Generic[T]):
    """`read()`'s value, served from memory and read again once older than `max_age_s`, so a change made through
    another replica sharing the database is in force here within that time; `refresh()` reads at once (this
    replica's own writes). The first read happens on first use."""

    def __init__(self, read: Callable[[], T], max_age_s: float, clock=time.monotonic):
        self._read, self.max_age_s, self.clock = read, max_age_s, clock
        self._loaded = float("-inf")

    def refresh(self) -> T:
        self._value = self._read()
        self._loaded = self.clock()
        return self._value

    def get(self) -> T:
        return self.refresh() if self.clock() - self._loaded > self.max_age_s else self._value
