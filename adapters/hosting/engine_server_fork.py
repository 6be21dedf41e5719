"""The engine-core server forked from the gateway itself, once the gateway has imported what the server would.

engine_processes.py forks every engine core from one server. Spawned, that server is a fresh interpreter importing
vLLM (PRELOAD) when the first engine starts: ~7.6 CPU s, and as many seconds on the start's path, to import what the
gateway has imported already. A gateway that will start CPU engines forks the server from itself instead, where that
is safe:

- after its imports, which run in the start-up thread while the event loop answers /health/live, and before any torch
  computation: GNU OpenMP does not survive fork, and a child of a process that has run a team can hang in its first;
- on the event loop's thread, between two of its steps, while the start-up thread, done with `prepare`, waits for it:
  the child copies no lock the loop or that thread held mid-write (the other threads there are OpenBLAS's idle
  workers, which OpenBLAS shuts down across a fork itself);
- with the wait policy the engines need already read: the OpenMP runtime reads OMP_WAIT_POLICY once, as torch loads.
  The spawned server loaded torch after the gateway had set it for its first version's engines; here it is in the
  environment while the gateway loads torch, from the settings alone, where they decide it before the engines are
  counted (teams shared step by step, fixed teams of one). Fixed teams of 2 or more, where the count decides, and
  CUDA keep the spawned server.

What the forked server does first (engine_processes._serve): it names itself `calm-engines` (its command line is the
gateway's; the engine cores forked from it keep the name), takes back the default signal handlers (blocked across the
fork) and points every inherited descriptor at /dev/null (the gateway's listening socket and pipes). Then it is
multiprocessing's forkserver loop, as a spawned one is. If the fork fails the first engine spawns the server as before.

The gateway's own OpenMP runtimes load with the engines' policy too (passive where teams are shared, the default);
its own torch work is small (a first run's merged weights).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from adapters.hosting.cpu_limits import usable_cpus
from adapters.hosting.engine_processes import PRELOAD, fork_engine_cores, fork_engine_server
from adapters.hosting.engine_settings import (
    CPU_DEFAULTS, EngineCountDecides, EngineOverrides, resolve, wait_policy_before_counting,
)
from calm_core.startup import stage


@dataclass(frozen=True)
class EngineServerFork:
    """The gateway's start-up steps before it builds its app: `prepare` in the start-up thread, `on_loop` on the event
    loop's thread (gateway/edge/starting.py runs them)."""

    overrides: EngineOverrides
    wait_policy: str | None  # OMP_WAIT_POLICY while torch loads; None: the environment's as it is

    @classmethod
    def planned(cls, overrides: EngineOverrides, environ: Mapping[str, str] = os.environ) -> EngineServerFork | None:
        """The fork for a gateway whose in-process engines have these settings; None where its engines keep the
        spawned server (CUDA, `spawn`, a wait policy the engine count decides, torch loaded already)."""
        if overrides.device == "cuda" or (overrides.engine_start or CPU_DEFAULTS["engine_start"]) != "forkserver":
            return None
        if "torch" in sys.modules:  # its OpenMP runtime has read the environment
            return None
        try:
            policy = wait_policy_before_counting(overrides.threads, overrides.executor or CPU_DEFAULTS["executor"],
                                                 usable_cpus(), environ)
        except EngineCountDecides:
            return None
        return cls(overrides, policy)

    def prepare(self) -> None:
        """The server's modules imported (and vLLM's engine-core start redirected to the server) under the engines' wait
        policy, which every OpenMP runtime they load reads (torch's; sklearn and sentencepiece bring their own), as the
        spawned server's imports did; left out of the environment after (InProcessVLLMEngine sets it for its engines as
        before). PRELOAD's last module, engine_server_frozen.py, collects and freezes the heap once, here: the server
        inherits it so (its own import of PRELOAD then finds every module loaded), and the gateway freezes what
        follows once started."""
        stage("importing vLLM for the gateway and its engine-core server")
        if self.wait_policy is not None:
            os.environ["OMP_WAIT_POLICY"] = self.wait_policy
        try:
            import torch  # noqa: F401 - first, for the device: a CUDA gateway spawns its engine cores
            if not self._on_cpu():
                return
            fork_engine_cores()
            for name in PRELOAD:
                importlib.import_module(name)
        finally:
            if self.wait_policy is not None:
                del os.environ["OMP_WAIT_POLICY"]

    def on_loop(self) -> int | None:
        """The server forked, where the device is the CPU; its pid."""
        return fork_engine_server() if self._on_cpu() else None

    def _on_cpu(self) -> bool:
        return resolve(self.overrides).device == "cpu"  # "auto" asks torch (loaded by `prepare`)
