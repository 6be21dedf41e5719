"""What a starting server is doing, for the operator who waits and for callers who arrive early.

Slow start-up steps (model conversion, merging weights, each engine) log a line on the "calm.startup" logger;
`StartupLog` prints each with the seconds since the command began and remembers the current one, which the gateway
names in its 503 "starting" answers.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

STARTUP = logging.getLogger("calm.startup")


def stage(message: str) -> None:
    STARTUP.info(message)


class StartupLog(logging.Handler):
    def __init__(self, stream: TextIO | None = None):
        super().__init__(logging.INFO)
        self.began = time.monotonic()
        self.current = "starting"
        self.stream = stream or sys.stdout

    def elapsed(self) -> float:
        return time.monotonic() - self.began

    def emit(self, record: logging.LogRecord) -> None:
        self.current = record.getMessage()
        print(f"[{self.elapsed():6.1f} s] {self.current}", file=self.stream, flush=True)

    def install(self) -> StartupLog:
        STARTUP.setLevel(logging.INFO)
        STARTUP.addHandler(self)
        STARTUP.propagate = False
        return self
