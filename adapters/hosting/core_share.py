"""The cores of a machine shared, step by step, among the in-process CPU engines that are computing at that moment.

A gateway runs several engines (the shipped one three: multiple choice's raw and one-pass passes, free form), each a
process with its own team of OpenMP threads, and which of them compute depends on the traffic: a multiple-choice
question keeps two busy, a free-form answer or a question without the raw pass one, mixed traffic all three. A fixed
team per engine is right for one mix only: the cores split three ways left a lone engine a third of the machine, and
teams as wide as the machine outnumbered the cores whenever two computed at once (a team then waits at every barrier
for a member the scheduler put aside). So each engine re-sizes its team before every step to its share of the usable
cores among the engines busy at that moment (`team_size`), read from a board they share: one row per engine, the
monotonic times its last step started and ended and the team it ran (a small file mapped by all of them; the gateway
creates it and hands each engine its row, adapters/vllm_plugins/core_share.py does the rest inside the engine core).

Measured side by side in benchmarks/results/engine_threads.md.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

SLOTS = 64  # engines of one process that share the cores (a gateway runs 3-4 per version); more keep fixed teams
PREFIX = "calm-cores-"  # a board's file: calm-cores-<pid>-<random>
STARTED, ENDED, TEAM = range(3)
# An engine counts as computing from the start of a step to this long after its end: the gap between two steps of a
# burst (scheduling, output handling) must not hand its cores to the others for one step and back.
BETWEEN_STEPS_S = 0.2
# A step that started and never ended (vLLM ran no forward pass after all: nothing was scheduled) stops counting after
# this long; longer than a step of the embedded model on CPU (a 2,048-token prefill on one core takes about 2 s).
LONGEST_STEP_S = 10.0


def remove_orphans(folder: Path) -> None:
    """Boards left by processes that died without closing theirs (killed): a file each, named after its process."""
    for path in folder.glob(f"{PREFIX}*"):
        pid = path.name.removeprefix(PREFIX).split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


def team_size(cpus: int, busy: int) -> int:
    """OpenMP threads for one of `busy` engines computing at once on `cpus` usable cores: an equal share, at least
    one."""
    return max(1, cpus // max(busy, 1))


def busy_engines(rows: np.ndarray, now: float) -> int:
    """Engines computing at `now`: in a step (started after its last end, and not long ago), or between two steps of
    a burst (ended within BETWEEN_STEPS_S)."""
    started, ended = rows[:, STARTED], rows[:, ENDED]
    in_step = (started > ended) & (now - started < LONGEST_STEP_S)
    between = (ended > 0) & (now - ended < BETWEEN_STEPS_S)
    return int(np.count_nonzero(in_step | between))


class CoreBoard:
    """The shared file: SLOTS rows of (step started, step ended, team), float64, in shared memory where the machine
    has it (/dev/shm). The creating process owns it (removes it with `close`); engine cores open it by path."""

    def __init__(self, path: str | Path, create: bool = False):
        self.path = Path(path)
        self.owner = create
        self.rows = np.memmap(self.path, dtype=np.float64, mode="w+" if create else "r+", shape=(SLOTS, 3))
        self._free = list(range(SLOTS)) if create else []

    @classmethod
    def create(cls) -> CoreBoard:
        folder = Path("/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
                      else tempfile.gettempdir())
        remove_orphans(folder)
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=folder)
        os.close(fd)
        return cls(path, create=True)

    def take_slot(self) -> int | None:
        """A row for an engine about to start, cleared (a row freed by a stopped engine is reused); None when every row
        is taken (that engine keeps the team it starts with)."""
        if not self._free:
            return None
        slot = self._free.pop(0)
        self.rows[slot] = 0.0
        return slot

    def free_slot(self, slot: int) -> None:
        self.rows[slot] = 0.0
        self._free.append(slot)

    def step_started(self, slot: int, now: float, cpus: int) -> int:
        """Marks the row's step started and returns the team it should run: its share among the busy engines."""
        self.rows[slot, STARTED] = now
        team = team_size(cpus, busy_engines(self.rows, now))
        self.rows[slot, TEAM] = team
        return team

    def step_ended(self, slot: int, now: float) -> None:
        self.rows[slot, ENDED] = now

    def went_idle(self, slot: int) -> None:
        """The engine has no request left: it stops counting at once (its last team stays on record)."""
        self.rows[slot, STARTED] = self.rows[slot, ENDED] = 0.0

    def team(self, slot: int) -> int | None:
        """The team the engine in `slot` last ran (None: it has not computed yet)."""
        team = int(self.rows[slot, TEAM])
        return team or None

    def close(self) -> None:
        if self.owner:
            self.path.unlink(missing_ok=True)


class CoreShares:
    """A process's board and the rows it handed to its engines, by engine key; the board's file is removed with the
    last of them."""

    def __init__(self):
        self._board: CoreBoard | None = None
        self._slots: dict[object, int] = {}

    def config(self, key, cpus: int) -> dict | None:
        """What the engine of `key` needs to share `cpus` cores (vLLM's additional_config), or None without a row."""
        self._board = self._board or CoreBoard.create()
        slot = self._board.take_slot()
        if slot is None:
            return None
        self._slots[key] = slot
        return {"path": str(self._board.path), "slot": slot, "cpus": cpus}

    def release(self, key) -> None:
        if key in self._slots:
            self._board.free_slot(self._slots.pop(key))
        if not self._slots and self._board is not None:
            self._board.close()
            self._board = None

    def team(self, key) -> int | None:
        """The team the engine of `key` ran its last step with (None: it shares no cores or has not computed)."""
        return self._board.team(self._slots[key]) if key in self._slots else None
