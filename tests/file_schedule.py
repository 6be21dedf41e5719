"""pytest-xdist's file-at-a-time scheduling (`--dist loadfile`) without its head start.

xdist hands a worker its next file once two of its tests are still pending. A worker holds what it was handed: in the
fresh clone of 3736e5a one worker was handed the fleet file as it started the retraining loop's two tests, ran them
(6 min) and then the fleet (4 min), while the other worker, out of files, idled for the last 6.5 minutes. A worker must
know its next test before it runs its last one, so one pending test is the least it can be handed more at; here it
is handed more only then. And a file handed to a worker whose pending test is long (the free-form loop is one test of
~9 minutes) would wait behind it while the other worker could have run it: that worker gets the shortest file left
instead, which it runs as soon as its long test ends, and then asks again. Pinned to the pytest-xdist version in
pyproject.toml (the methods below are its scheduler's own).
"""

from __future__ import annotations

import math

from xdist.scheduler import LoadFileScheduling

LONG_TEST_S = 60.0  # a worker with more than this left of its pending tests gets the shortest file, not the next


class OneFileAhead(LoadFileScheduling):
    def __init__(self, config, log=None, seconds: dict[str, float] | None = None):
        """`seconds`: each file's seconds in the published run (benchmarks/results/test-times.md)."""
        super().__init__(config, log)
        self.seconds = seconds or {}

    def _left_s(self, node) -> float:
        """The published seconds of the node's pending tests (a file's seconds shared evenly among its tests)."""
        left = 0.0
        for scope, tests in self.assigned_work[node].items():
            pending = list(tests.values()).count(False)
            left += self.seconds.get(scope, 0.0) * pending / max(len(tests), 1)
        return left

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work[node]) > 1:
            return
        self._assign_work_unit(node)

    def _assign_work_unit(self, node) -> None:
        if self._left_s(node) > LONG_TEST_S:
            shortest = min(self.workqueue, key=lambda scope: self.seconds.get(scope, math.inf))
            self.workqueue.move_to_end(shortest, last=False)
        super()._assign_work_unit(node)
