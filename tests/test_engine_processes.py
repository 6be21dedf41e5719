"""Engine cores forked from a preloaded server (adapters/hosting/engine_processes.py): a forked child starts with the
server's environment, fixed when the server started; the process must carry its parent's, as spawn does."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from adapters.hosting.engine_processes import EngineCoreContext, EnvCarryingProcess
from calm_core.collector import THRESHOLDS_AT_START, YOUNG_GENERATION_THRESHOLD
from tests.servers import REPO, python


def report_variable(name: str, queue) -> None:
    queue.put(os.environ.get(name))


@pytest.fixture
def context(monkeypatch):
    monkeypatch.delenv("CALM_TEST_SET_AFTER_THE_SERVER", raising=False)
    return EngineCoreContext()


def run_and_read(context, name: str) -> str | None:
    queue = context.Queue()
    proc = context.Process(target=report_variable, args=(name, queue))
    proc.start()
    value = queue.get(timeout=120)
    proc.join(120)
    assert proc.exitcode == 0
    return value


def test_a_variable_set_after_the_server_started_reaches_the_child(context, monkeypatch):
    # The server is running (started by this process's first forkserver child) before the variable exists.
    assert run_and_read(context, "CALM_TEST_SET_AFTER_THE_SERVER") is None
    monkeypatch.setenv("CALM_TEST_SET_AFTER_THE_SERVER", "carried")
    assert run_and_read(context, "CALM_TEST_SET_AFTER_THE_SERVER") == "carried"


def test_a_plain_forkserver_child_would_not_see_it(context, monkeypatch):
    """What the carrying is for: the same sequence with multiprocessing's own forkserver process misses the value."""
    assert run_and_read(context, "CALM_TEST_SET_AFTER_THE_SERVER") is None  # the server runs
    monkeypatch.setenv("CALM_TEST_SET_AFTER_THE_SERVER", "carried")
    plain = multiprocessing.get_context("forkserver")
    queue = plain.Queue()
    proc = plain.Process(target=report_variable, args=("CALM_TEST_SET_AFTER_THE_SERVER", queue))
    proc.start()
    assert queue.get(timeout=120) is None
    proc.join(120)


def report_collector(queue) -> None:
    import gc

    queue.put((gc.get_threshold()[0], gc.get_freeze_count()))


def test_the_engine_server_imports_collecting_less_and_forks_engine_cores_from_a_frozen_heap():
    """The server sets the collector before its imports (PRELOAD's first module) and collects and freezes what it
    imported after them (its last); a forked engine core starts with that heap frozen and CPython's collector. In fresh
    interpreters with CPython's setting and only those two modules preloaded (vLLM's would cost ~8 s)."""
    assert int(python("import gc, importlib; from adapters.hosting.engine_processes import PRELOAD; "
                      "importlib.import_module(PRELOAD[0]); print(gc.get_threshold()[0])")) == YOUNG_GENERATION_THRESHOLD
    threshold, frozen = map(int, python(textwrap.dedent("""
        import multiprocessing
        from adapters.hosting.engine_processes import PRELOAD, EngineCoreContext

        if __name__ == "__main__":
            multiprocessing.set_forkserver_preload([PRELOAD[0], "tests.test_engine_processes", PRELOAD[-1]])
            context = EngineCoreContext()
            queue = context.Queue()
            from tests.test_engine_processes import report_collector
            child = context.Process(target=report_collector, args=(queue,))
            child.start(); print(*queue.get(timeout=120)); child.join(120)
    """)).split())
    assert threshold == THRESHOLDS_AT_START[0]
    assert frozen > 10_000, frozen  # the server's modules (pytest's and this file's among them); 0 without the last module


def gloo_loop_threads(pid: int | str = "self") -> int:
    """Threads of a process named as gloo's TCP loop threads are (a loop thread names itself as it runs: count where
    they have long run, such as a started gateway's engine cores)."""
    tasks = f"/proc/{pid}/task"
    return sum(open(f"{tasks}/{t}/comm").read().strip() == "gloo_tcp_loop" for t in os.listdir(tasks))


GLOO_GROUPS = textwrap.dedent("""
    import os, sys, tempfile
    import torch, torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from adapters.hosting.gloo_device import share_one_gloo_device

    def threads() -> int:  # a thread is listed once it is created (a loop thread names itself later, when it runs)
        return len(os.listdir("/proc/self/task"))

    shared = sys.argv[1] == "shared" and share_one_gloo_device()
    folder = tempfile.TemporaryDirectory()
    dist.init_process_group("gloo", init_method=f"file://{folder.name}/store", rank=0, world_size=1)
    before = threads()
    groups = [dist.new_group([0], backend="gloo") for _ in range(12)]  # vLLM's CPU worker makes 13 with the world's
    # each group starts its worker threads; what it starts beyond them is a device's loop thread
    loops = threads() - before - 12 * c10d.ProcessGroupGloo._Options()._threads
    x = torch.arange(3.0)
    dist.all_reduce(x, group=groups[3]); dist.broadcast(x, 0, group=groups[7]); dist.barrier(group=groups[11])
    # torch's checks see a backend it hands back from C++ (of the stock class) as a ProcessGroupGloo
    known = isinstance(groups[5]._get_backend(torch.device("cpu")), c10d.ProcessGroupGloo)
    dist.destroy_process_group()
    print(shared, loops, x.tolist() == [0.0, 1.0, 2.0], known)
""")


@pytest.mark.parametrize("way", ["stock", "shared"])
def test_an_engine_cores_gloo_groups_share_one_loop_thread(way):
    """12 gloo groups more in one process, as vLLM's CPU worker makes them: torch's own way starts a TCP device and its
    loop thread (waking every 10 ms) for each; with adapters/hosting/gloo_device.py none (the world group's serves them
    all), and the groups work as before. Threads counted as created, not by name: a loop thread names itself only once
    it runs (a suite run once counted 10 of 13 named)."""
    shared, loops, summed, known = python(GLOO_GROUPS, way).split()
    assert (shared, loops, summed, known) == (("True", "0") if way == "shared" else ("False", "12")) + ("True", "True")


def test_the_context_makes_carrying_processes_and_forkserver_queues(context):
    assert isinstance(context.Process(target=print), EnvCarryingProcess)
    assert context.get_start_method() == "forkserver"


def report_threads(queue) -> None:
    import torch

    queue.put(torch.get_num_threads())


def test_a_forked_engine_core_runs_the_openmp_thread_count_its_parent_set():
    """The server has loaded torch (as it does vLLM's modules), so OpenMP read OMP_NUM_THREADS there, once; the
    engine's count, set later, reaches a carrying child's torch, and would not reach a plain forkserver child's. In a
    fresh interpreter: this process's forkserver may already run without torch, where the difference cannot show."""
    wanted = len(os.sched_getaffinity(0)) + 1  # not what torch picks by itself (the usable cores)
    script = textwrap.dedent(f"""
        import multiprocessing, os
        from adapters.hosting.engine_processes import EngineCoreContext
        from tests.test_engine_processes import report_threads as report

        if __name__ == "__main__":
            multiprocessing.set_forkserver_preload(["torch"])
            context = EngineCoreContext()
            queue = context.Queue()
            first = context.Process(target=report, args=(queue,))
            first.start(); before = queue.get(timeout=120); first.join(120)  # the server runs, torch loaded
            os.environ["OMP_NUM_THREADS"] = "{wanted}"
            results = []
            for process in (context.Process, multiprocessing.get_context("forkserver").Process):
                child = process(target=report, args=(queue,))
                child.start(); results.append(queue.get(timeout=120)); child.join(120)
            print(before, *results)
    """)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    before, carried, plain = map(int, out.stdout.split())
    assert carried == wanted
    assert plain == before != wanted  # what a forked engine core ran before: the server's count


def forkserver_spin_counts(engines: int, threads: int | None) -> list[str]:
    """The spin counts libgomp reports (OMP_DISPLAY_ENV) in a fresh interpreter whose version starts `engines` CPU
    engines of `threads` each and then forks an engine core: this process's, and the forkserver's, which loaded torch
    after the version set its environment."""
    script = textwrap.dedent(f"""
        import multiprocessing, types
        from adapters.hosting.engine_processes import EngineCoreContext
        from adapters.clients.inprocess import InProcessVLLMEngine
        from tests.test_engine_processes import report_threads as report

        if __name__ == "__main__":
            multiprocessing.set_forkserver_preload(["torch"])
            engine = types.SimpleNamespace(device="cpu", threads={threads}, executor="uni")
            version = types.SimpleNamespace(config=types.SimpleNamespace(engine=engine), threads=None, share_cpus=None)
            InProcessVLLMEngine._share_cores(version, {engines})
            context = EngineCoreContext()
            queue = context.Queue()
            child = context.Process(target=report, args=(queue,))
            child.start(); print(queue.get(timeout=120)); child.join(120)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO), "OMP_DISPLAY_ENV": "VERBOSE"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == (threads or 1)  # shared teams start as the split: 1 on these machines
    return [line.split("=")[1].strip(" '") for line in out.stderr.splitlines() if "GOMP_SPINCOUNT =" in line]


def test_engine_cores_whose_teams_may_outnumber_the_cores_start_with_a_passive_openmp_runtime():
    """Fixed teams that outnumber the cores (CALM_ENGINE_THREADS=2, more engines than cores) and teams shared step by
    step reach the forked engine core's OpenMP runtime as OMP_WAIT_POLICY=PASSIVE (libgomp: spin count 0); fixed
    teams that fit keep libgomp's spin."""
    cpus = len(os.sched_getaffinity(0))
    assert forkserver_spin_counts(engines=cpus + 1, threads=2) == ["0"]  # the forkserver's: the test loads no torch
    assert forkserver_spin_counts(engines=1, threads=1) == ["300000"]
    if cpus > 1:  # teams shared step by step (the default) can take every core: passive too
        assert forkserver_spin_counts(engines=cpus + 1, threads=None) == ["0"]


def test_engine_cores_and_their_server_exit_when_the_gateway_is_killed(tmp_path):
    """A gateway killed outright (SIGKILL, the OOM killer) leaves no forked engine core and no server behind: the
    child is the server's, not the gateway's, and holds the server's liveness pipe, so without watching the gateway
    both ran on (~2 GB an engine core; found orphaned 50 minutes after a profiling run killed its gateway)."""
    import psutil

    from tests.servers import alive, wait_until

    script = tmp_path / "gateway.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from adapters.hosting.engine_processes import EngineCoreContext

        if __name__ == "__main__":
            child = EngineCoreContext().Process(target=time.sleep, args=(600,))
            child.start()
            print(child.pid, flush=True)
            time.sleep(600)
    """))
    gateway = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    started = []
    try:
        child = int(gateway.stdout.readline())
        started = psutil.Process(gateway.pid).children(recursive=True)
        assert child in {p.pid for p in started} and len(started) >= 2  # the server (and its tracker), the child
        gateway.kill()
        gateway.wait(60)
        wait_until("the forked child and the server to exit", lambda: not any(map(alive, started)), 60, 0.1)
    finally:
        gateway.kill()
        for p in filter(alive, started):
            p.kill()


def report_forked(queue) -> None:
    """An engine core forked from a server forked from its gateway: what it sees of that server and of itself."""
    import gc
    import signal

    server = os.getppid()
    links = []
    for fd in os.listdir(f"/proc/{server}/fd"):
        try:
            links.append(os.readlink(f"/proc/{server}/fd/{fd}"))
        except OSError:
            continue
    with open(f"/proc/{server}/stat") as stat:
        server_parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{server}/comm") as comm:
        name = comm.read().strip()
    queue.put({"server": server, "server_parent": server_parent, "server_name": name, "server_links": links,
               "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, "frozen": gc.get_freeze_count()})


def test_a_gateway_forks_its_engine_server_after_loading_torch_with_the_engines_wait_policy():
    """`calm serve` with CPU engines (adapters/hosting/engine_server_fork.py): torch loaded in the start-up thread with the
    wait policy its engines need, the server forked on the event loop's thread, an engine core forked from that server.
    The OpenMP runtime is initialised once, in the gateway, and passive (no core spins at a barrier); the policy is
    not left in the gateway's environment; the server is the gateway's child, named calm-engines, holding none of the
    gateway's descriptors (its listening socket) and none of its signal handlers, and it exits once the gateway lets go
    of it; the core's heap is frozen."""
    import json

    from adapters.hosting.cpu_limits import usable_cpus

    script = textwrap.dedent("""
        import asyncio, json, os, select, signal, socket, sys
        from multiprocessing import forkserver
        from adapters.hosting import engine_processes
        from adapters.hosting.engine_server_fork import EngineServerFork
        from adapters.hosting.engine_settings import EngineOverrides
        from tests.test_engine_processes import report_forked

        # The server's modules cut to torch (the rest of vLLM's change nothing here).
        engine_processes.PRELOAD[:] = [engine_processes.PRELOAD[0], "torch", engine_processes.PRELOAD[-1]]

        async def gateway():
            listening = socket.create_server(("127.0.0.1", 0))  # the gateway's, open as it starts
            signal.signal(signal.SIGTERM, lambda *_: None)  # its server's handler (uvicorn sets one)
            plan = EngineServerFork.planned(EngineOverrides(device="cpu"))
            await asyncio.to_thread(plan.prepare)
            print("prepared", file=sys.stderr, flush=True)
            left = os.environ.get("OMP_WAIT_POLICY")
            server = plan.on_loop()
            context = engine_processes.EngineCoreContext()
            queue = context.Queue()
            core = context.Process(target=report_forked, args=(queue,))
            core.start()
            seen = queue.get(timeout=120)
            core.join(120)
            # The gateway lets go of the server (as its exit would): with no client left holding the liveness pipe,
            # the server ends on its own, within a minute or not at all.
            os.close(forkserver._forkserver._forkserver_alive_fd)
            select.select([os.pidfd_open(server)], [], [], 60)
            ended, status = os.waitpid(server, os.WNOHANG)
            print(json.dumps({"gateway": os.getpid(), "forked": server, "policy": plan.wait_policy, "left": left,
                              "socket": f"socket:[{os.fstat(listening.fileno()).st_ino}]", "core_exit": core.exitcode,
                              "server_exit": os.waitstatus_to_exitcode(status) if ended else None, **seen}))

        if __name__ == "__main__":
            asyncio.run(gateway())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO), "OMP_DISPLAY_ENV": "VERBOSE"})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    passive = usable_cpus() > 1
    assert seen["policy"] == ("PASSIVE" if passive else None) and seen["left"] is None
    # Each OpenMP runtime's settings, printed as it loads: torch's, sklearn's and sentencepiece's (vLLM imports both), in
    # the gateway's start-up thread, passive; none after (the server and the core have the gateway's runtimes).
    loaded, after = out.stderr.split("prepared\n")
    spin = [line.split("=")[1].strip(" '") for line in loaded.splitlines() if "GOMP_SPINCOUNT =" in line]
    assert len(spin) >= 1 and set(spin) == ({"0"} if passive else {"300000"}), spin
    assert "OPENMP DISPLAY ENVIRONMENT BEGIN" not in after, after[-3000:]
    assert seen["server"] == seen["forked"] and seen["server_parent"] == seen["gateway"]
    assert seen["server_name"] == "calm-engines" and seen["core_exit"] == 0
    assert seen["socket"] not in seen["server_links"], seen["server_links"]
    assert seen["server_exit"] == 0 and seen["sigterm_default"]  # the core has the server's handlers
    assert seen["frozen"] > 10000
