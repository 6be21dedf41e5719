"""tests/file_schedule.py against pytest-xdist's own file scheduling, on a simulated run: two workers that behave as
xdist's do (a test runs once the worker knows its next one, or has been told to shut down), the files and test times
of the end of the fresh clone of 3736e5a, and the same file order for both schedulers."""

from __future__ import annotations

import heapq
from types import SimpleNamespace

from xdist.scheduler import LoadFileScheduling

from tests.file_schedule import OneFileAhead


class Worker:
    def __init__(self, name: str):
        self.name, self.queue, self.shutting_down = name, [], False
        self.gateway = SimpleNamespace(id=name)  # what xdist names a worker by in its messages

    def send_runtest_some(self, indices: list[int]) -> None:
        self.queue.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def simulate(scheduler_class, files: dict[str, list[float]], **kwargs) -> tuple[float, dict[str, list[str]]]:
    """(the time the last test ends, the files each worker ran) with `files` (file -> its tests' seconds, in order)."""
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=False))
    scheduler = scheduler_class(config, **kwargs)
    collection = [f"{f}::t{i}" for f, times in files.items() for i in range(len(times))]
    seconds = {f"{f}::t{i}": s for f, times in files.items() for i, s in enumerate(times)}
    workers = [Worker("gw0"), Worker("gw1")]
    for w in workers:
        scheduler.add_node(w)
        scheduler.add_node_collection(w, collection)
    scheduler.schedule()
    now, running, ran = 0.0, [], {w.name: [] for w in workers}
    busy = set()
    while True:
        for w in workers:
            if w.name not in busy and (len(w.queue) >= 2 or (w.shutting_down and w.queue)):
                index = w.queue.pop(0)
                nodeid = collection[index]
                if not ran[w.name] or ran[w.name][-1] != nodeid.split("::")[0]:
                    ran[w.name].append(nodeid.split("::")[0])
                heapq.heappush(running, (now + seconds[nodeid], w.name, index))
                busy.add(w.name)
        if not running:
            assert all(not w.queue for w in workers), "a worker was left holding tests it could not run"
            return now, ran
        now, name, index = heapq.heappop(running)
        busy.discard(name)
        scheduler.mark_test_complete(next(w for w in workers if w.name == name), index)


# The end of the fresh clone of 3736e5a (seconds per test): the retraining loop, the fleet and the default gateway files
# after a few short ones, in tests/conftest.py's order.
END_OF_RUN = {"tests/test_store.py": [1.0] * 4, "tests/test_retrain_loop.py": [297.0, 74.0],
              "tests/test_fleet.py": [110.0, 40.0, 30.0, 50.0, 54.0], "tests/test_gateway_default.py": [21.0] * 12}


def test_no_worker_holds_a_file_the_other_could_run():
    xdist_end, xdist_ran = simulate(LoadFileScheduling, END_OF_RUN)
    seconds = {f: sum(t) for f, t in END_OF_RUN.items()}
    ours_end, ours_ran = simulate(OneFileAhead, END_OF_RUN, seconds=seconds)
    # xdist hands the fleet to the worker that starts the retraining loop: it runs 371 + 284 s while the other runs the
    # default gateway (252 s) and then waits.
    assert any(ran[-2:] == ["tests/test_retrain_loop.py", "tests/test_fleet.py"] for ran in xdist_ran.values()), xdist_ran
    assert xdist_end >= 371 + 284
    assert ours_end <= xdist_end - 100, (ours_end, xdist_end, ours_ran)


def test_a_long_single_test_gets_the_shortest_file_behind_it():
    """A worker starting a one-test file must be handed its next file at once: xdist hands it the next in order, which
    then waits out the long test; here it gets the shortest, and the other worker runs the rest meanwhile."""
    files = {"tests/test_long.py": [500.0], "tests/test_big.py": [40.0] * 5, "tests/test_mid.py": [30.0] * 5,
             "tests/test_other.py": [20.0] * 5, "tests/test_tiny.py": [0.5] * 3}
    seconds = {f: sum(t) for f, t in files.items()}
    xdist_end, xdist_ran = simulate(LoadFileScheduling, files)
    ours_end, ours_ran = simulate(OneFileAhead, files, seconds=seconds)
    assert next(ran for ran in xdist_ran.values() if ran[0] == "tests/test_long.py")[1] == "tests/test_mid.py"
    assert next(ran for ran in ours_ran.values() if ran[0] == "tests/test_long.py")[1:] == ["tests/test_tiny.py"]
    assert (xdist_end, ours_end) == (650.0, 501.5)
