"""Gateway settings from the environment (prefix CALM_), refusing unsafe defaults outside development."""

from __future__ import annotations

import json
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from adapters.hosting.cpu_limits import omp_threads_set
from adapters.hosting.engine_settings import EngineOverrides
from calm_core.paths import calm_home
from gateway.policy.targets import TARGET_NAME, Target

DEV_ADMIN_KEY = "dev-admin-key"


class EngineKind(str, Enum):
    INPROCESS = "inprocess"
    UPSTREAM = "upstream"


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CALM_", env_nested_delimiter="__")

    environment: str = "development"  # "production" refuses the development admin key
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # None = embedded default; or a local HF folder / hub id
    served_model_name: str = "calm-smollm2-135m"
    artifact: str | None = None  # None = the default artifact for the embedded model
    engine: EngineKind = EngineKind.INPROCESS
    upstream_urls: Annotated[list[str], NoDecode] = []
    # The engines one by one when CALM_UPSTREAM_URLS is a balancer in front of them: each loads and checks a version
    # before the gateway routes to it (default: the upstream URLs themselves).
    upstream_engine_urls: Annotated[list[str], NoDecode] = []
    upstream_timeout_s: float = 30.0
    upstream_connect_timeout_s: float = 2.0
    max_model_len: int = 2048
    # Engine settings: unset ones come from the device (adapters/hosting/engine_settings.py; /health shows what is in force).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: str | None = None  # CPU float32, CUDA bfloat16
    enforce_eager: bool | None = None  # CPU true, CUDA false (CUDA graphs)
    kv_cache_mb: int | None = Field(default=None, gt=0)  # CPU 512; on CUDA a fixed size replaces the GPU share
    gpu_memory_utilization: float | None = None  # CUDA 0.9
    enable_prefix_caching: bool | None = None  # CUDA true; CPU vLLM's default
    block_size: int | None = Field(default=None, gt=0)  # KV-cache block (the prefix cache's unit): vLLM's default
    adapter_mode: Literal["merged", "lora"] | None = None  # CPU merged copies, CUDA vLLM multi-LoRA
    executor: Literal["uni", "mp"] | None = None  # CPU "uni" (the model in the engine-core process), CUDA vLLM's
    engine_start: Literal["forkserver", "spawn"] | None = None  # CPU "forkserver" (engine cores forked), CUDA "spawn"
    # OpenMP threads per in-process CPU engine, fixed; unset: OMP_NUM_THREADS if the environment sets it, else each
    # engine's share of the usable cores among the engines computing, re-sized every step (adapters/hosting/core_share.py).
    engine_threads: int | None = Field(default=None, gt=0)
    # OMP_NUM_THREADS as the operator set it, read once: the first version's engines set it for their own start
    # (InProcessVLLMEngine._share_cores), and a later version read then would get fixed teams instead of shared ones.
    _omp_threads: int | None = PrivateAttr(default_factory=omp_threads_set)
    # `calm engine` on CPU: tcmalloc preloaded when installed (adapters/hosting/allocator.py), or the system's allocator
    engine_allocator: Literal["tcmalloc", "system"] = "tcmalloc"
    admin_key: str = DEV_ADMIN_KEY
    # Shared by the gateways of one operator that escalate to each other (protocol "calm"): a request proves it was
    # escalated by one of them with an HMAC under it (gateway/edge/peer.py); unset, no request skips this gateway's hand-off.
    peer_secret: SecretStr | None = None
    # The key the fleet's vLLM servers require (their --api-key or VLLM_API_KEY): vLLM's servers otherwise answer anyone
    # who reaches them, run-time adapter loading included. Sent as a bearer token on every request to them.
    upstream_api_key: SecretStr | None = None
    # The servers policies may call (gateway/policy/targets.py): name -> {url, api_key_env | api_key_file, protocol, private},
    # as JSON; an escalate policy's `target` and a review policy's `webhook` name one of them.
    targets: dict[str, Target] = {}
    # Client API keys for /v1/* (`calm keys`, /admin/keys): required in production unless set otherwise; in
    # development a request without a key (or with a placeholder that is not a calm key) passes.
    require_api_keys: bool | None = None
    db_path: Path = Field(default_factory=lambda: Path(".calm/gateway.sqlite3"))
    # PostgreSQL instead of the SQLite file, for replicas sharing one database: postgresql+psycopg://user:pw@host/db
    db_url: str | None = None

    @property
    def database(self) -> str:
        return self.db_url or str(self.db_path)
    # The artifact registry's folder (immutable versions); its metadata lives in the database above. Default: beside
    # the SQLite file, or $CALM_HOME/registry with PostgreSQL. Replicas sharing a database share this folder too.
    registry_dir: Path | None = None
    # Where the registry lives when machines share no volume (s3://bucket/prefix, any fsspec URL); registry_dir is
    # then this machine's copy of the versions it uses.
    registry_url: str | None = None
    registry_poll_s: float = Field(default=2.0, gt=0)  # how soon a promotion made elsewhere serves here
    # Known domains besides the artifact's reference domains; others map to "other".
    domains: Annotated[list[str], NoDecode] = []
    drift_window: int = 200
    feedback_window: int = 500
    max_tokens_limit: int = 1024
    max_body_bytes: int = Field(default=1_000_000, gt=0)  # larger request bodies: 413
    max_in_flight: int = Field(default=256, gt=0)  # generation requests being served per replica; beyond: 429
    request_deadline_s: float = Field(default=300.0, gt=0)  # a request still running then: 504 (a stream: its event)
    # Engine sequences one request may start (options x option tokens, samples, n, prompts and the token-by-token
    # read-back of free-form answers multiply it): beyond, 400. Unset: 16 x (max_tokens_limit + 1), room for 8 answers
    # of the longest allowed length read back (<= 2 sequences a token); a batch of prompts shares it.
    max_engine_sequences: int | None = Field(default=None, gt=0)
    # How often a replica adds its keys' engine work to the shared tally and reads the others' (gateway/edge/usage.py).
    usage_sync_s: float = Field(default=1.0, gt=0)
    stream_write_timeout_s: float = Field(default=30.0, gt=0)  # a stream whose client reads nothing this long: closed
    drain_s: float = Field(default=30.0, ge=0)  # on shutdown, time given to requests in flight to finish
    # An idle client connection is closed after this long. Longer than the idle timeouts of the balancers and clients
    # that reuse connections (AWS ALB 60 s, nginx 60 s): a server closing first races a request sent on the connection
    # at that moment, which then fails without an answer (uvicorn's 5 s default did so in the load test).
    keep_alive_s: int = Field(default=75, gt=0)
    # A connection whose request headers are not complete this long after it opened (or after the request's first
    # byte) is closed: uvicorn has no header-read timeout of its own (gateway/edge/http_server.py).
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)  # and its body this long after its headers, else closed
    default_top_logprobs: int = 5
    # The answers served: "multiple_choice" refuses free-form requests (no options, neither `options` nor "A. ..." lines
    # in the prompt) with a 400, so that in process no engine is started for them: not the free-form mode's (1.65 GB
    # and 9 CPU s of start-up on CPU: benchmarks/results/engine_start_answers.md), nor, beside merged adapter weights,
    # the base weights'. Upstream, the version's free-form mode is not loaded on the fleet's engines.
    answers: Literal["all", "multiple_choice"] = "all"
    raw_confidence: bool = True  # default for multiple choice; a request overrides it with calm.raw_confidence
    # Free form only when asked: token confidence's raw number is a second prefill of prompt + answer, 1.66x the
    # engine's CPU per answer (benchmarks/results/free_form_batching.md).
    free_form_raw_confidence: bool = False
    # Cloze heads whose shifts are one constant are folded into a copy of the weights (in-process), so each option is
    # one request scored from prompt log-probs; false keeps one request per option token through the logits processor.
    one_pass_scoring: bool = True
    option_prefix_reuse: bool = True  # one-pass options after the first read the question from vLLM's prefix cache
    risk_refit_every: int = Field(default=25, ge=1)  # guaranteed-risk policies: refit after this many new verdicts

    @field_validator("upstream_urls", "upstream_engine_urls", "domains", mode="before")
    @classmethod
    def _list(cls, value):
        """A list from the environment: a JSON list, or comma-separated (`http://e1:8000,http://e2:8000`, one URL)."""
        if not isinstance(value, str):
            return value
        if value.lstrip().startswith("["):
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"{value!r} is neither a JSON list nor comma-separated") from None
        return [item.strip() for item in value.split(",") if item.strip()]

    @field_validator("targets")
    @classmethod
    def _target_names(cls, value: dict[str, Target]) -> dict[str, Target]:
        bad = [name for name in value if not re.fullmatch(TARGET_NAME, name)]
        if bad:
            raise ValueError(f"target names are letters, digits, '_', '.', '-' (at most 64): {bad}")
        return value

    @property
    def registry_root(self) -> Path:
        if self.registry_dir is not None:
            return self.registry_dir
        if self.db_url:
            return calm_home() / "registry"
        return self.db_path.parent / "registry"

    @property
    def free_form_answers(self) -> bool:
        return self.answers == "all"

    @property
    def engine_sequences_per_request(self) -> int:
        return self.max_engine_sequences or 16 * (self.max_tokens_limit + 1)

    @property
    def api_keys_required(self) -> bool:
        # Every environment but exactly "development" is served as production: a "prod" or "staging" typo or a name of
        # the operator's own must not leave the gateway open to anyone without a key.
        return self.environment != "development" if self.require_api_keys is None else self.require_api_keys

    def engine_overrides(self) -> EngineOverrides:
        return EngineOverrides(device=self.device, dtype=self.dtype, enforce_eager=self.enforce_eager,
                               kv_cache_mb=self.kv_cache_mb, gpu_memory_utilization=self.gpu_memory_utilization,
                               enable_prefix_caching=self.enable_prefix_caching, block_size=self.block_size,
                               adapter_mode=self.adapter_mode,
                               executor=self.executor, engine_start=self.engine_start,
                               threads=self.engine_threads or self._omp_threads)

    @model_validator(mode="after")
    def _safe(self):
        # An empty key (a variable or secret that resolved to nothing) would match "Authorization: Bearer" with no key.
        if not self.admin_key.strip():
            raise ValueError("CALM_ADMIN_KEY is empty: set a key, or leave it unset in development")
        if self.environment != "development" and self.admin_key == DEV_ADMIN_KEY:
            raise ValueError("set CALM_ADMIN_KEY: the development admin key is refused outside development")
        if self.engine is EngineKind.UPSTREAM and not self.upstream_urls:
            raise ValueError('CALM_UPSTREAM_URLS must list at least one vLLM server for engine "upstream"')
        return self


def peer_secret(settings: GatewaySettings) -> str | None:
    """The fleet's peer secret as text (gateway/edge/peer.py), None where the operator set none."""
    return settings.peer_secret.get_secret_value() if settings.peer_secret is not None else None
