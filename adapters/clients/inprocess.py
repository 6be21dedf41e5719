"""vLLM's async engine inside the gateway process (the embedded default)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

from adapters.hosting.cpu_limits import usable_cpus
from adapters.hosting.engine_processes import fork_engine_cores
from adapters.hosting.core_share import CoreShares, team_size
from adapters.hosting.engine_settings import EngineOverrides, EngineSettings, engine_wait_policy, resolve
from adapters.hosting.merged_weights import built_merged_dir, merged_model_dir
from adapters.vllm_plugins.common import (ADAPTER_NAME, CORE_SHARE_KEY, CORE_SHARE_PROCESSOR, HEAD_ARG_KEY, OPT_OUT_KEY,
                                  EngineConfig, register_registry_root)
from adapters.clients.vllm_outputs import deltas_from_output
from adapters.hosting.model_runner import model_runner
from calm_core.artifact import load_artifact, read_manifest
from calm_core.engine import EngineDelta, EngineRejected, EngineRequest, EngineUnavailable
from calm_core.startup import stage


def engine_args(kwargs: dict, core_share: dict | None):
    """vLLM's arguments for an in-process engine, with the step-by-step core sharing (adapters/vllm_plugins/core_share.py)
    configured where given."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    # The step hook is a V1 logits processor: Model Runner V2 would refuse it by name (vLLM with Triton on a CPU).
    if core_share is not None and model_runner() == "v1":
        kwargs = {**kwargs, "logits_processors": [*kwargs["logits_processors"], CORE_SHARE_PROCESSOR],
                  "additional_config": {**kwargs["additional_config"], CORE_SHARE_KEY: core_share}}
    return AsyncEngineArgs(**kwargs, disable_log_stats=True)


class SharedEngines:
    """vLLM engines of this process by what they compute: weights, α head (by content) and LoRA adapter. Artifact
    versions that need the same engine share it (a retrained version keeps its parent's free-form mode: the same
    weights and head), and it shuts down when the last version using it closes."""

    def __init__(self):
        self._engines: dict[tuple, object] = {}
        self._users: dict[tuple, int] = {}
        self._cores = CoreShares()  # CPU engines sharing the cores step by step
        # One lock per key and event loop (tests run several loops): engines of different keys start at the same time,
        # a second user of a key waits for the first one's engine instead of starting another.
        self._locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def acquire(self, key: tuple, build, share_cpus: int | None = None):
        """The engine of `key`, built by `build(core_share)` unless it runs: `core_share` is the additional config of
        an engine that sizes its team among the others step by step on `share_cpus` cores (None: a fixed team)."""
        locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        async with locks.setdefault(key, asyncio.Lock()):
            if key not in self._engines:
                share = self._cores.config(key, share_cpus) if share_cpus is not None else None
                try:
                    self._engines[key] = await asyncio.to_thread(build, share)
                except BaseException:
                    self._cores.release(key)
                    raise
                self._users[key] = 0
            self._users[key] += 1
            return self._engines[key]

    def release(self, key: tuple) -> None:
        self._users[key] -= 1
        if self._users[key] == 0:
            self._engines.pop(key).shutdown()
            del self._users[key]
            self._cores.release(key)

    def team(self, key: tuple) -> int | None:
        """The OpenMP team the engine of `key` ran its last step with, where it shares the cores step by step."""
        return self._cores.team(key)

    def __len__(self) -> int:
        return len(self._engines)


SHARED = SharedEngines()
_LORA_IDS: dict[str, int] = {}


def lora_id(adapter_path: str) -> int:
    """vLLM's integer id of an adapter: one per adapter folder in this process (registry versions never change)."""
    return _LORA_IDS.setdefault(os.path.abspath(adapter_path), len(_LORA_IDS) + 1)


def engine_weights(cfg: EngineConfig) -> dict[str, str]:
    """The weights each engine of a version serves: "base", and "adapter" (merged), "folded" and "free_form" where
    configured. With merged adapter weights multiple choice never runs on the base weights (it runs on the adapter's
    and the folded copy's), and free form only where the artifact has no free-form mode (one fitted to multiple choice
    only answers it there, without a head): the base engine starts only where free form is served without such a
    mode. Free form refused (`free_form_answers` false), no engine is kept for it."""
    free_form_on_base = cfg.free_form_answers and cfg.free_form_model_path is None
    unused_base = cfg.merged_model_path is not None and not free_form_on_base
    paths = {"base": None if unused_base else cfg.model_path, "adapter": cfg.merged_model_path,
             "folded": cfg.folded_model_path, "free_form": cfg.free_form_model_path if cfg.free_form_answers else None}
    return {w: p for w, p in paths.items() if p}


class InProcessVLLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_name = config.served_model_name
        self.artifact_version = load_artifact(config.artifact_path).manifest.artifact_version
        self.max_model_len = config.max_model_len
        self.folded_scoring = config.folded_model_path is not None
        self.free_form_mode = "free_form" in engine_weights(config)
        self.prompt_logprobs = True  # returns prompt log-probs (raw free-form confidence, one-pass scoring)
        # Prompt log-probs may be read after the prefix cache (`reuse_prefix`), where every engine caches prefixes, in
        # blocks of `prefix_block` tokens (both read from the engines once started).
        self.prefix_reuse, self.prefix_block = False, 0
        self._engines: dict[str, object] = {}  # "base" | "adapter" | "folded" | "free_form" -> AsyncLLM
        self._keys: dict[str, tuple] = {}  # the same -> its key in SHARED
        self.threads: int | None = None  # the fixed OpenMP team of each engine this version starts (CPU, when set)
        self.wait_policy: str | None = None  # OMP_WAIT_POLICY its engines start with (None: libgomp's spin-then-sleep)
        self.share_cpus: int | None = None  # else: the cores its engines share step by step (adapters/hosting/core_share.py)

    async def start(self) -> None:
        """One engine on the base weights; with an adapter, either a second one on base + adapter merged (adapter mode
        "merged", CPU's default) or the adapter as a vLLM LoRA in the first ("lora", CUDA's default); with one-pass
        scoring, one more on the folded weights; with a free-form mode in the artifact, one on its weights (adapter
        merged, in both adapter modes) with its own α head.

        Merged rather than vLLM's per-request LoRA on CPU: there vLLM's LoRA path runs as plain PyTorch ops over every
        layer and made cloze scoring about 6x slower (benchmarks/scoring/bench_cloze_serving.py); merged weights cost nothing
        per token. The price is a copy of the (small) weights and KV cache. On CUDA vLLM's LoRA kernels serve adapters
        without copies.
        """
        os.environ.update(self.config.env())  # read by the logits processor in the engine-core process
        from vllm.v1.engine.async_llm import AsyncLLM

        register_registry_root(self.config.registry_root)  # requests name versions there (validated in this process)
        if self.config.engine.engine_start == "forkserver":
            fork_engine_cores()  # for every engine this process starts from now on

        paths = self._weights()
        share_cpus = self._share_cores(len(paths))
        builds = {}
        for weights, path in paths.items():
            lora = weights == "base" and self.config.adapter_path is not None  # the adapter as a vLLM LoRA
            head = self.config.free_form_artifact_path if weights == "free_form" else None
            kwargs = self.config.engine_kwargs(path, lora=lora, artifact_path=head)
            if "gpu_memory_utilization" in kwargs:  # each engine takes its share of the GPU: the share is split
                kwargs["gpu_memory_utilization"] /= len(paths)
            if lora:
                # vLLM multi-LoRA: one engine on the base weights serves every version's adapter (a LoRA request per
                # version) and head (named per request, `calm_head`), up to MAX_LORAS adapters resident at once.
                key = (path, "multi-lora", kwargs["max_lora_rank"])
            else:  # merged weights: shared by versions that compute the same thing (weights, and head by content)
                key = (path, read_manifest(head or self.config.artifact_path)["head_sha256"])

            def build(core_share: dict | None, kwargs=kwargs):
                # In a thread: an engine takes tens of seconds to start, and a gateway loading another artifact
                # version (hot swap) goes on serving meanwhile. vLLM starts its output handler on the first request.
                return AsyncLLM.from_engine_args(engine_args(kwargs, core_share))

            builds[weights] = (key, build)

        async def acquire(weights: str, key: tuple, build) -> None:
            self._engines[weights] = await SHARED.acquire(key, build, share_cpus)
            self._keys[weights] = key
            stage(f"version {self.artifact_version}: engine {weights!r} answers")

        stage(f"version {self.artifact_version}: starting {len(builds)} vLLM engines ({', '.join(builds)})"
              f"{self._threads_note()}")

        # Together: most of an engine's start is its two spawned processes importing vLLM, and they overlap on the
        # machine's cores (3 engines of the embedded model: 47 s one after the other, 40 s together on 2 cores).
        started = await asyncio.gather(*(acquire(w, k, b) for w, (k, b) in builds.items()), return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await self.close()  # the engines this version already acquired are released too
            raise failed[0]
        caches = [engine.vllm_config.cache_config for engine in self._engines.values()]
        self.prefix_reuse = self.config.option_prefix_reuse and all(c.enable_prefix_caching for c in caches)
        self.prefix_block = max(c.block_size for c in caches)

    def _share_cores(self, engines: int) -> int | None:
        """On CPU, how the OpenMP teams of the `engines` this version starts are sized; returns the usable cores where
        they share them step by step (the default: adapters/hosting/core_share.py), None otherwise. A thread count set by the
        operator (CALM_ENGINE_THREADS, OMP_NUM_THREADS) is every engine's fixed team instead. Teams that may outnumber
        the cores wait passively (`engine_wait_policy`). Each engine core takes OMP_NUM_THREADS as it starts (a
        forked one too: adapters/hosting/engine_processes.py); the OpenMP runtime reads the wait policy once, as it loads: a
        forked core has the forkserver's, which started with this process's first engine, so the first version's
        engines decide it for the process (a spawned core reads its own); a server `calm serve` forked from itself has
        the gateway's, loaded with the policy this sets, decided by the settings before any engine was counted
        (adapters/hosting/engine_server_fork.py)."""
        if self.config.engine.device != "cpu":
            return None
        cpus = usable_cpus()
        if self.config.engine.threads is None:
            if self.config.engine.executor != "uni":
                return None  # vLLM's "mp" executor binds each worker's OpenMP threads to cores of its own choosing
            # Until the first step sizes it: the split, as engines starting together compute at once (profiling runs).
            os.environ["OMP_NUM_THREADS"] = str(team_size(cpus, engines))
            self.share_cpus = cpus
        else:
            self.threads = self.config.engine.threads
            os.environ["OMP_NUM_THREADS"] = str(self.threads)
        policy = engine_wait_policy(self.threads, engines, cpus, os.environ)
        if policy is not None:
            os.environ["OMP_WAIT_POLICY"] = policy
        self.wait_policy = os.environ.get("OMP_WAIT_POLICY")
        return self.share_cpus

    def _threads_note(self) -> str:
        """How the engines' OpenMP teams are sized, for the start-up line."""
        if self.share_cpus is not None:
            note = f", OpenMP teams sized every step to a share of {self.share_cpus} cores"
        elif self.threads is not None:
            note = f", {self.threads} OpenMP thread(s) each"
        else:
            return ""
        return note + (f" (OMP_WAIT_POLICY={self.wait_policy})" if self.wait_policy else "")

    def _engine_for(self, request: EngineRequest):
        if request.folded:
            return self._engines.get("folded")
        if request.free_form:
            return self._engines.get("free_form")
        return self._engines.get("adapter" if request.adapter else "base") or self._engines.get("base")

    def _sampling_params(self, request: EngineRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        if request.json_schema is not None:
            structured = StructuredOutputsParams(json=request.json_schema)
        elif request.json_object:
            structured = StructuredOutputsParams(json_object=True)
        kwargs = dict(
            n=request.n,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=dict(request.logit_bias) or None,
            structured_outputs=structured,
            seed=request.seed,
            stop=list(request.stop) or None,
            output_kind=RequestOutputKind.DELTA,
            extra_args=self._head_args(request),
            prompt_logprobs=0 if request.prompt_logprobs else None,
        )
        if request.prompt_logprobs and request.reuse_prefix and self.prefix_reuse:
            # vLLM skips the cache for prompt log-probs by default. Read anyway, the cached rows are stale token ids
            # that its detokenizer cannot decode: scoring needs no text.
            kwargs.update(skip_reading_prefix_cache=False, detokenize=False)
        if request.option_token_ids:
            kwargs.update(logprob_token_ids=list(request.option_token_ids))
            if request.restrict_to_options:
                kwargs.update(allowed_token_ids=list(request.option_token_ids))
        elif request.top_logprobs:
            kwargs.update(logprobs=request.top_logprobs)
        else:
            kwargs.update(logprobs=0)  # the sampled token's own log-prob
        return SamplingParams(**kwargs)

    def _on_multi_lora(self, request: EngineRequest) -> bool:
        """The request runs on the base engine shared by every version (adapter mode "lora"): it names its version's
        adapter and head there; every other engine carries its own weights and head."""
        return "multi-lora" in self._keys.get("base", ()) and self._engine_for(request) is self._engines["base"]

    def _head_args(self, request: EngineRequest) -> dict | None:
        if not request.calibrated:
            return {OPT_OUT_KEY: False}
        return {HEAD_ARG_KEY: self.config.version_name} if self._on_multi_lora(request) else None

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        engine = self._engine_for(request)
        if engine is None or engine.errored:
            raise EngineUnavailable("the in-process vLLM engine is not running")
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            params = self._sampling_params(request)
        except (VLLMClientError, ValueError) as e:
            raise EngineRejected(str(e)) from None
        started = False
        lora = None
        if request.adapter and self._on_multi_lora(request):
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(f"{ADAPTER_NAME}-{self.artifact_version}", lora_id(self.config.adapter_path),
                               self.config.adapter_path)
        try:
            prompt = {"prompt_token_ids": list(request.prompt_token_ids)} if request.prompt_token_ids else request.prompt
            async for out in engine.generate(prompt, params, request.request_id, lora_request=lora):
                for delta in deltas_from_output(out, started):
                    yield delta
                started = True
        except VLLMClientError as e:
            raise EngineRejected(str(e)) from None
        except EngineDeadError as e:
            raise EngineUnavailable(f"the in-process vLLM engine died: {e}") from None
        except ValueError as e:
            # vLLM validates a request (structured-output schemas among others) with plain ValueErrors when it is
            # submitted; once output has arrived, a ValueError is a fault, not the caller's: a 500.
            if started:
                raise
            raise EngineRejected(str(e)) from None

    def _weights(self) -> dict[str, str]:
        return engine_weights(self.config)

    def describe(self) -> dict:
        adapter = "merged" if self.config.merged_model_path else ("lora" if self.config.adapter_path else None)
        return {"kind": "inprocess", "engines": list(self._weights()), "adapter": adapter,
                "engines_in_process": len(SHARED), **self.config.engine.as_dict(), "threads": self.threads,
                "omp_wait_policy": self.wait_policy, "core_share": self._core_share()}

    def _core_share(self) -> dict | None:
        """The cores shared step by step and each engine's team in its last step (None: not computed yet)."""
        if self.share_cpus is None:
            return None
        return {"cpus": self.share_cpus, "teams": {w: SHARED.team(k) for w, k in self._keys.items()}}

    async def abort(self, request_id: str) -> None:
        for engine in self._engines.values():
            await engine.abort(request_id)  # ids are unique, so aborting in the engine that lacks it is a no-op

    def dead(self) -> str | None:
        """Why this engine can never serve again, else None: vLLM restarts no engine core that died (its own server
        exits then), so only a new process serves again (the gateway's liveness probe)."""
        for weights, engine in self._engines.items():
            if engine.errored:
                return f"the in-process vLLM engine serving the {weights} weights died"
        return None

    async def check_health(self) -> None:
        if not self._engines:
            raise EngineUnavailable("engine not started")
        try:
            for engine in self._engines.values():
                await engine.check_health()
        except Exception as e:
            raise EngineUnavailable(f"engine unhealthy: {e}") from None

    async def close(self) -> None:
        for weights in list(self._engines):
            if weights in self._keys:
                SHARED.release(self._keys.pop(weights))
        self._engines = {}


def offline_settings(overrides: EngineOverrides) -> EngineSettings:
    """The gateway's engine settings as offline scoring runs them: on CPU with merged adapters whatever the gateway's
    device (so without its GPU share)."""
    return resolve(replace(overrides, device="cpu", adapter_mode="merged", gpu_memory_utilization=None))


@asynccontextmanager
async def artifact_engine(base_model: str, artifact_dir: str,
                          overrides: EngineOverrides | None = None) -> AsyncIterator[InProcessVLLMEngine]:
    """An `EngineFactory` for offline evaluation: vLLM in process on the artifact's weights with its α head in the
    logits processor, as the gateway serves it. The adapter merged: the copy in the cache when a gateway has served the
    version (the shipped one, a parent being judged), else a temporary one, removed afterwards (a candidate that may be
    rejected leaves no half-gigabyte copy behind). `overrides`: the gateway's engine settings (CALM_KV_CACHE_MB,
    CALM_ENGINE_START, ...), as `offline_settings` applies them."""
    settings = offline_settings(overrides or EngineOverrides())
    artifact = load_artifact(artifact_dir)
    with tempfile.TemporaryDirectory() as tmp:
        weights = built_merged_dir(base_model, artifact) or merged_model_dir(base_model, artifact, Path(tmp))
        engine = InProcessVLLMEngine(EngineConfig(model_path=str(weights), artifact_path=str(artifact_dir),
                                                  engine=settings, max_model_len=1024))
        await engine.start()
        try:
            yield engine
        finally:
            await engine.close()
