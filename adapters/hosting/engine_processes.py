"""How the engine-core processes of this process's vLLM engines start: forked from one server that imported vLLM once.

vLLM runs each engine core in a process of its own, and its CPU platform starts it with `spawn`: a fresh interpreter
that imports torch and vLLM again, ~9 s of CPU of the ~11.5 s an engine core takes to answer on the 2-core machines.
A gateway holds 3-4 engines and starts more on every promotion. Here they come from Python's multiprocessing
forkserver instead: one clean interpreter imports vLLM once (PRELOAD) and forks each engine core from itself, which
then only loads its weights. Not `fork` from the gateway itself once it runs: it runs threads and has run OpenMP, after
which a forked child can deadlock; the server has done neither. `python benchmarks/engines/bench_engine_start.py
--compare start` measures both ways side by side. The server is either spawned, a fresh interpreter importing PRELOAD
as the first engine starts, or (`calm serve` with CPU engines: fork_engine_server, engine_server_fork.py) a fork of the
gateway taken before either is true, right after the gateway imported PRELOAD itself.

The one difference from spawn that matters: a forked child has the server's environment, fixed when the server
started, while vLLM (and InProcessVLLMEngine) set variables for an engine core just before starting it. So each
process carries its parent's environment as it was at start() and takes it on first thing, as a spawned one would,
OpenMP's thread count included (read by the OpenMP runtime once, when the server loaded torch).

The other: a forked child's parent is the server, not the process that started it, and every child holds the server's
liveness pipe open, so neither notices when that process dies without shutting its engines down (SIGKILL, the OOM
killer): the server and its engine cores, ~2 GB each, would run on. Each child watches the process that started it
and, when it exits, terminates itself as that process's shutdown would (SIGTERM: vLLM's engine core tears down); the
server exits once its last child has.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import traceback
from multiprocessing.context import ForkServerProcess

from adapters.hosting.cpu_limits import omp_threads_set
from adapters.hosting.gloo_device import share_one_gloo_device
from calm_core.collector import collect_as_cpython

log = logging.getLogger(__name__)
# What the server imports before it forks: first the collector's setting (before the imports it is for), then the engine
# core, the CPU worker and model code it runs for the embedded model, and our logits processor and LoRA resolver (vLLM's
# plugins), last the heap collected and frozen (after the imports it is for). A module missing here is imported by each
# child.
PRELOAD = ["adapters.hosting.engine_server_preamble", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.attention.backends.cpu_attn",
           "vllm.model_executor.model_loader", "vllm.model_executor.models.llama", "adapters.vllm_plugins.alpha",
           "adapters.vllm_plugins.core_share", "adapters.vllm_plugins.lora_resolver", "adapters.hosting.engine_server_frozen"]
SERVER_NAME = "calm-engines"  # a server forked from the gateway (fork_engine_server) has the gateway's command line
# multiprocessing.forkserver's private protocol that fork_engine_server speaks (main's signature of CPython 3.8-3.12;
# 3.13 adds a key, and then the server is spawned)
_FORKSERVER_MAIN = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
_installed = False


class EnvCarryingProcess(ForkServerProcess):
    """A forkserver process that starts as an engine core should: CPython's collector (and the server's heap frozen, as
    the server left it: engine_server_frozen.py), the environment its parent had when it called start(), and one gloo
    device for its process groups."""

    def start(self) -> None:
        self._parent_env = dict(os.environ)
        self._starter_pid = os.getpid()
        super().start()

    def run(self) -> None:
        collect_as_cpython()  # the server's setting was for its imports (engine_server_preamble.py)
        os.environ.clear()
        os.environ.update(self._parent_env)
        if "torch.distributed" in sys.modules:  # preloaded: an engine core (not worth importing torch for elsewhere)
            share_one_gloo_device()  # before vLLM makes its 13 process groups (gloo_device.py), in the parent's environment
        apply_omp_threads()
        terminate_with(self._starter_pid)
        super().run()


def terminate_with(pid: int) -> None:
    """SIGTERM to this process once process `pid` has exited, watched from a daemon thread through a pidfd (an event,
    not a poll); a warning where the kernel offers no pidfd (Linux before 5.3)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # it died while this process started
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (AttributeError, OSError) as e:
        log.warning("cannot watch process %s (%s): this process outlives it if it dies without stopping it", pid, e)
        return

    def watch() -> None:
        select.select([pidfd], [], [])  # readable once the process has exited
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name=f"exit-with-{pid}", daemon=True).start()


def apply_omp_threads() -> None:
    """OpenMP read OMP_NUM_THREADS when the server loaded torch, so a forked child's own value would go unread; a
    spawned engine core reads it as it loads torch. Set it the same way here (torch is preloaded: no import cost)."""
    threads = omp_threads_set()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


class EngineCoreContext:
    """What vLLM's `get_mp_context()` returns: processes as above; queues, events and the rest the forkserver's."""

    def __init__(self):
        self._context = multiprocessing.get_context("forkserver")

    def Process(self, *args, **kwargs) -> EnvCarryingProcess:  # noqa: N802 (multiprocessing's name)
        return EnvCarryingProcess(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def fork_engine_cores() -> bool:
    """Every engine core this process starts from now on forks from the preloaded server. False, and vLLM's own spawn
    kept, where this vLLM starts engine cores some other way than through `vllm.v1.engine.utils.get_mp_context`."""
    global _installed
    import vllm.v1.engine.utils as engine_utils

    if _installed:
        return True
    if not callable(getattr(engine_utils, "get_mp_context", None)):
        log.warning("this vLLM has no get_mp_context in vllm.v1.engine.utils: engine cores spawn (each imports vLLM)")
        return False
    multiprocessing.set_forkserver_preload(PRELOAD)
    context = EngineCoreContext()
    engine_utils.get_mp_context = lambda: context
    _installed = True
    return True


def fork_engine_server() -> int | None:
    """Start the engine-core server now as a fork of this process, which has imported PRELOAD (instead of a fresh
    interpreter importing it when the first engine starts); the server's pid. adapters/hosting/engine_server_fork.py says
    when a process may: no OpenMP team run yet, no other thread mid-way through work the child needs. None, and the
    first engine starts the server as before, where one runs already, this Python's forkserver or this vLLM is not the
    one this speaks to, or the fork fails (a strict overcommit limit refuses a copy of the gateway that spawn avoids)."""
    from multiprocessing import connection, forkserver, resource_tracker, util

    if list(inspect.signature(forkserver.main).parameters) != _FORKSERVER_MAIN:
        log.warning("this Python's multiprocessing.forkserver differs: the engine-core server is spawned")
        return None
    if not fork_engine_cores():
        return None
    server = forkserver._forkserver
    with server._lock:
        if server._forkserver_pid is not None:
            return None
        resource_tracker.ensure_running()  # one tracker, started here: the children are sent its descriptor
    listener, pipe = None, ()
    try:
        # As ForkServer.ensure_running makes them for the interpreter it spawns (not under its lock: the child has a copy).
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        pipe = os.pipe()  # every client holds the write end: the server exits when the last has closed it
        pid = _fork(listener.fileno(), pipe[0])
    except OSError as e:
        log.warning("the engine-core server could not be forked from this process (%s): it is spawned", e)
        if listener is not None:
            listener.close()
        for fd in pipe:
            os.close(fd)
        return None
    alive_r, alive_w = pipe
    os.close(alive_r)
    listener.close()
    with server._lock:
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return pid


# What a signal sent to the gateway's process group would do to the child between fork and its own handlers: the
# gateway's uvicorn handler would swallow SIGTERM there. Blocked across the fork, they reach the child once it has
# defaults.
_HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


def _fork(listener_fd: int, alive_r: int) -> int:
    for stream in (sys.stdout, sys.stderr):  # else each engine core flushes the copy of what was buffered as it exits
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    held = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        pid = os.fork()
        if pid == 0:
            _serve(listener_fd, alive_r, held)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    return pid


def _serve(listener_fd: int, alive_r: int, mask: set) -> None:
    """The forked server: multiprocessing's forkserver loop, once it is what a spawned one would be. Never returns."""
    import asyncio
    from multiprocessing import forkserver

    code = 0
    try:
        _name_process(SERVER_NAME)
        _default_signal_handlers()
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        asyncio.set_event_loop(None)  # the gateway's loop, whose descriptors are released below (3.12 does this at fork)
        _release_descriptors(keep={0, 1, 2, listener_fd, alive_r})
        forkserver.main(listener_fd, alive_r, PRELOAD)  # raises SystemExit once the last client has gone
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except BaseException:  # noqa: BLE001 - the gateway's own handlers must not run in this process
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _name_process(name: str) -> None:
    """The process's name as `ps`, psutil and /proc/PID/comm show it (prctl PR_SET_NAME, at most 15 bytes)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _default_signal_handlers() -> None:
    """The handlers a fresh interpreter has: the gateway's server installed its own (SIGTERM would stop nothing here)."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _release_descriptors(keep: set[int]) -> None:
    """Every inherited descriptor but `keep` pointed at /dev/null: the gateway's listening socket, pipes and whatever
    else it had open are released, and no number is freed for reuse under a Python object that still holds it (closing
    would)."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"):
        fd = int(name)
        if fd in keep or fd == null:
            continue
        try:
            os.fstat(fd)  # the listing's own descriptor is closed by now
        except OSError:
            continue
        os.dup2(null, fd, inheritable=False)
    if null > 2:  # else it stands in for a standard stream the gateway started without
        os.close(null)
