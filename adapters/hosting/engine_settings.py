"""Engine settings by device, one typed object for `calm serve` (in-process) and `calm engine` (vLLM's server).

On CPU the values that run today on the 2-core machines: float32 (matches HF transformers to ~5e-5; bf16 drifts),
eager execution, a fixed KV cache in bytes, an artifact's adapter merged into a copy of the weights (vLLM's CPU
LoRA path runs as plain PyTorch ops and was 6x slower), and the model run inside the engine-core process ("uni"
executor) instead of a worker process of its own: one process fewer to spawn and import vLLM in per engine, which
halves an engine's start (benchmarks/engines/bench_engine_start.py) at the same throughput; and engine cores forked from one
server that imported vLLM once instead of each spawned (adapters/hosting/engine_processes.py). On CUDA, vLLM's own defaults:
bfloat16, CUDA graphs, the KV cache sized as a share of GPU memory, prefix caching, and adapters served by vLLM's
multi-LoRA kernels in the same engine. Every value can be set explicitly (environment `CALM_*` or CLI); unset ones
come from the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal

Device = Literal["cpu", "cuda"]
AdapterMode = Literal["merged", "lora"]
Executor = Literal["uni", "mp"]
EngineStart = Literal["forkserver", "spawn"]
# vLLM's CPU platform replaces the "uni" executor by "mp" unless this is "0" where the engine's config is made.
SINGLE_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# A seeded request (the OpenAI `seed`, and every semantic-confidence sample: its seed comes from the prompt) whose prompt
# vLLM prefills in chunks kills a CPU engine: after each partial step vLLM rewinds the request's random generator by an
# offset, which only CUDA's generator has ("CPU Generator does not use offset"). On CPU each prompt is therefore
# prefilled in one step (vLLM's own switch, as its CPU platform sets for MLA models); samples also no longer depend
# on how a prompt was split, so a seeded answer is the same alone and in a full batch (tests/test_gateway_default.py).
CPU_CHUNKED_PREFILL = False
# Engines on CPU read answers token by token: a fleet engine (`calm engine`, a stock server) scores options with a
# request per option token, and every engine reads a free-form answer back through the head with a request per answer
# token (calm_core/scorers/free_form.py), each re-reading the question and the answer so far, which the prefix cache
# serves only from full blocks; vLLM's CPU block of 128 tokens is more than these prompts hold, and its CPU attention
# takes multiples of 32 (benchmarks/results/engine_block_size.md, benchmarks/results/read_back.md).
FLEET_CPU_BLOCK_SIZE = 32


@dataclass(frozen=True)
class EngineOverrides:
    """What an operator set; None means "the device's default"."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str | None = None
    enforce_eager: bool | None = None
    kv_cache_mb: int | None = None  # a fixed KV cache (CPU's way); on CUDA it replaces gpu_memory_utilization
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    block_size: int | None = None  # tokens per KV-cache block, the prefix cache's unit
    adapter_mode: AdapterMode | None = None
    executor: Executor | None = None
    engine_start: EngineStart | None = None
    threads: int | None = None  # OpenMP threads per in-process CPU engine; None: shared step by step (core_share)


@dataclass(frozen=True)
class EngineSettings:
    """The values in force, after the device's defaults filled what was not set (reported by /health)."""

    device: Device
    dtype: str
    enforce_eager: bool
    kv_cache_bytes: int | None  # None: gpu_memory_utilization sizes the cache
    gpu_memory_utilization: float | None
    enable_prefix_caching: bool | None  # None: vLLM's own default for the platform
    enable_chunked_prefill: bool | None  # None: vLLM's own default (on); off on CPU (CPU_CHUNKED_PREFILL)
    block_size: int | None  # None: vLLM's own default for the platform
    adapter_mode: AdapterMode
    executor: Executor | None  # None: vLLM's own choice ("uni" for one GPU)
    # How an in-process engine's core process starts: forked from a server that imported vLLM once
    # (adapters/hosting/engine_processes.py), or vLLM's own spawn (a fresh interpreter per engine; forced on CUDA anyway).
    engine_start: EngineStart
    threads: int | None  # OpenMP threads per in-process CPU engine; None: sized step by step (adapters/hosting/core_share.py)

    def as_dict(self) -> dict:
        return asdict(self)

    def vllm_kwargs(self) -> dict:
        """Engine-argument names as vLLM's AsyncEngineArgs takes them."""
        kwargs = dict(dtype=self.dtype, enforce_eager=self.enforce_eager)
        if self.executor is not None:
            kwargs["distributed_executor_backend"] = self.executor
        if self.enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = self.enable_prefix_caching
        if self.enable_chunked_prefill is not None:
            kwargs["enable_chunked_prefill"] = self.enable_chunked_prefill
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes
        else:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        return kwargs

    def server_args(self) -> list[str]:
        """The same values as vLLM OpenAI-server flags."""
        args = ["--dtype", self.dtype]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.executor is not None:
            args += ["--distributed-executor-backend", self.executor]
        if self.enable_prefix_caching is not None:
            args.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.enable_chunked_prefill is not None:
            args.append("--enable-chunked-prefill" if self.enable_chunked_prefill else "--no-enable-chunked-prefill")
        if self.block_size is not None:
            args += ["--block-size", str(self.block_size)]
        if self.kv_cache_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        else:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return args

    def env(self) -> dict[str, str]:
        """Environment the process that builds the engine's config needs for these values."""
        return dict(SINGLE_PROCESS_ENV) if self.executor == "uni" else {}


CPU_DEFAULTS = dict(dtype="float32", enforce_eager=True, kv_cache_mb=512, gpu_memory_utilization=None,
                    enable_prefix_caching=None, block_size=FLEET_CPU_BLOCK_SIZE, adapter_mode="merged", executor="uni",
                    engine_start="forkserver")
CUDA_DEFAULTS = dict(dtype="bfloat16", enforce_eager=False, kv_cache_mb=None, gpu_memory_utilization=0.9,
                     enable_prefix_caching=True, block_size=None, adapter_mode="lora", executor=None,
                     engine_start="spawn")


def detect_device() -> Device:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(overrides: EngineOverrides, detected: Device | None = None) -> EngineSettings:
    """Fill what the operator left unset from the device's defaults. `detected` stands in for CUDA detection (tests)."""
    device: Device = overrides.device if overrides.device != "auto" else (detected or detect_device())
    defaults = CUDA_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    pick = lambda name: getattr(overrides, name) if getattr(overrides, name) is not None else defaults[name]  # noqa: E731
    kv_mb = pick("kv_cache_mb")
    gpu_share = overrides.gpu_memory_utilization if overrides.gpu_memory_utilization is not None else (
        None if overrides.kv_cache_mb is not None else defaults["gpu_memory_utilization"])
    if device == "cpu" and overrides.gpu_memory_utilization is not None:
        raise ValueError("gpu_memory_utilization applies to CUDA; on CPU set kv_cache_mb")
    if overrides.kv_cache_mb is not None and overrides.gpu_memory_utilization is not None:
        raise ValueError("set kv_cache_mb or gpu_memory_utilization, not both")
    if gpu_share is not None and not 0.0 < gpu_share <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {gpu_share}")
    return EngineSettings(
        device=device, dtype=pick("dtype"), enforce_eager=pick("enforce_eager"),
        kv_cache_bytes=kv_mb * 1024**2 if kv_mb is not None else None,
        gpu_memory_utilization=gpu_share if kv_mb is None else None,
        enable_prefix_caching=pick("enable_prefix_caching"),
        enable_chunked_prefill=CPU_CHUNKED_PREFILL if device == "cpu" else None, block_size=pick("block_size"),
        adapter_mode=pick("adapter_mode"),
        executor=pick("executor"), engine_start=pick("engine_start"), threads=overrides.threads,
    )


def engine_wait_policy(threads: int | None, engines: int, cpus: int, environ: Mapping[str, str]) -> str | None:
    """OMP_WAIT_POLICY for in-process CPU engines: PASSIVE where their teams together may outnumber the usable cores,
    so that a thread waiting at a barrier sleeps instead of spinning on a core another engine's team, or the gateway's
    own process, needs. libgomp's default spins first (GOMP_SPINCOUNT) and only throttles that when one process's team
    outnumbers the cores, which no single engine's does. `threads`: each engine's fixed team (an operator set
    CALM_ENGINE_THREADS or OMP_NUM_THREADS), or None where the teams share the cores step by step
    (adapters/hosting/core_share.py: a lone engine's team takes every core, beside the gateway's event loop). Teams of 2 on
    2 cores, three engines, spinning: multiple choice at 0.42x the questions/s of passive ones for 2.4x the CPU, and a
    lone team answering free-form questions at 0.83x the tokens/s for 1.7x the CPU
    (benchmarks/results/engine_threads.md).
    None where no team can wait for another's cores (teams of one, few enough, one core) or the operator chose a policy
    (OMP_WAIT_POLICY or GOMP_SPINCOUNT set)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    if threads is None:
        return "PASSIVE" if cpus > 1 else None
    return "PASSIVE" if threads > 1 and threads * engines > cpus else None


class EngineCountDecides(ValueError):
    """The wait policy depends on how many engines a version starts (fixed teams of 2 or more)."""


def wait_policy_before_counting(threads: int | None, executor: str, cpus: int, environ: Mapping[str, str]) -> str | None:
    """What InProcessVLLMEngine._share_cores will set OMP_WAIT_POLICY to for CPU engines, known before they are counted
    (adapters/hosting/engine_server_fork.py loads the OpenMP runtime before): none for vLLM's "mp" executor with teams
    left to vLLM, else `engine_wait_policy`. EngineCountDecides where the count matters."""
    if threads is None and executor != "uni":
        return None
    fewest, most = (engine_wait_policy(threads, engines, cpus, environ) for engines in (1, cpus + 1))
    if fewest != most:
        raise EngineCountDecides(f"fixed OpenMP teams of {threads}: the policy depends on the number of engines")
    return fewest


# How far a bf16 engine's numbers may be from HF transformers in fp32 (absolute), measured on the embedded model with
# vLLM's CPU bf16 kernels (tests/test_bf16_budget.py: option probabilities ≤ 0.006, raw confidence ≤ 0.014,
# free-form confidence ≤ 0.03) with headroom. fp32 engines hold 1e-3. A deployment that needs bit-level agreement
# sets CALM_DTYPE=float32.
BF16_BUDGET = {"option_probability": 0.02, "raw_confidence": 0.03, "free_form_confidence": 0.05}
