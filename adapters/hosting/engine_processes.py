"""How the engine-core processes of this process's vLLM engines start: forked from one server that imported vLLM once.

vLLM runs each engine core in a process of its own, and its CPU platform starts it with `spawn`: a fresh interpreter
that imports torch and vLLM again, ~9 s of CPU of the ~11.5 s an engine core takes to answer on the 2-core machines.
A gateway holds 3-4 engines and starts more on every promotion. Here they come from Python's multiprocessing
forkserver instead: one clean interpreter imports vLLM once (PRELOAD) and forks each engine core from itself, which
then only loads its weights. Not `fork` from the gateway itself: it runs threads and has run OpenMP, after which a
forked child can deadlock; the server has done neither. `python benchmarks/engines/bench_engine_start.py --compare start`
measures both ways side by side.

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

import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
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
