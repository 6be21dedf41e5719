"""Composition from settings of the gateway, the engine server and offline scoring's engines (kept out of `gateway`,
which imports no engine)."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

from adapters.clients.inprocess import InProcessVLLMEngine, artifact_engine
from adapters.hosting.allocator import tcmalloc_library, with_allocator
from adapters.hosting.engine_settings import FLEET_CPU_BLOCK_SIZE, resolve
from adapters.hosting.merged_weights import foldable, folded_model_dir, merged_model_dir
from adapters.vllm_plugins.common import REGISTRY_ENV, RUNTIME_LORA_ENV, EngineConfig
from calm_cli.common import gateway_settings
from calm_core.artifact import load_artifact
from calm_core.errors import CalmError
from calm_core.hashing import vocab_sha256
from calm_core.models import EMBEDDED_ID, ResolvedModel, model_tokenizer, model_vocab_size, resolve_model
from calm_core.paths import BUNDLED_DIR
from calm_core.startup import stage
from gateway.settings import EngineKind

DEFAULT_ARTIFACTS = {EMBEDDED_ID: BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"}


def default_artifact(model: ResolvedModel) -> Path:
    if model.id not in DEFAULT_ARTIFACTS:
        raise CalmError(f"no default alpha-head artifact for model {model.id!r}: set CALM_ARTIFACT (or --artifact); "
                        "`calm artifacts identity --out DIR --model ...` writes an uncalibrated one")
    return DEFAULT_ARTIFACTS[model.id]


def load_checked(model: ResolvedModel, artifact_path: Path, tokenizer=None):
    """(tokenizer, artifact): the artifact verified against the model's tokenizer (loaded unless given: a gateway
    loading another version passes its own, since a tokenizer load holds the GIL for most of a second and stalls the
    requests the gateway serves meanwhile) and vocabulary."""
    if tokenizer is None:
        tokenizer = model_tokenizer(Path(model.path))
    artifact = load_artifact(artifact_path, expect_vocab_size=model_vocab_size(Path(model.path)),
                             expect_tokenizer_sha256=vocab_sha256(tokenizer.get_vocab()))
    return tokenizer, artifact


def engine_config(settings, model: ResolvedModel, artifact_path: Path, artifact=None, inprocess: bool = False):
    """The base model and the α head as the logits processor; each request chooses base or adapted weights. The
    artifact's LoRA adapter (if any) is served in-process merged into a second engine (adapter_mode "merged", CPU's
    default) or by vLLM's LoRA kernels in the same engine ("lora", CUDA's default), and as a vLLM LoRA by the
    `calm engine` server. In-process, a cloze head that folds into the LM head gets a third engine on the
    folded weights (one-pass option scoring, adapters/hosting/merged_weights.py), and an artifact with a free-form mode one
    more on that mode's merged weights with its own head, unless the gateway serves multiple choice only
    (CALM_ANSWERS)."""
    artifact = artifact if artifact is not None else load_artifact(artifact_path)
    adapter = artifact.adapter_dir
    engine = resolve(settings.engine_overrides())
    common = dict(model_path=str(model.path), artifact_path=str(artifact_path), served_model_name=settings.served_model_name,
                  engine=engine, max_model_len=settings.max_model_len)
    lora = dict(adapter_path=str(adapter), adapter_rank=artifact.adapter_rank) if adapter else {}
    if not inprocess:  # a fleet engine: every version by name from the gateways' registry
        if engine.device == "cpu" and settings.block_size is None:
            common["engine"] = replace(engine, block_size=FLEET_CPU_BLOCK_SIZE)
        return EngineConfig(**common, **lora, registry_dir=str(settings.registry_root))
    one_pass = (settings.one_pass_scoring and artifact.manifest.answer_format == "cloze" and foldable(artifact.head))
    folded = str(folded_model_dir(model.path, artifact)) if one_pass else None
    free_form = dict(free_form_answers=settings.free_form_answers)
    # An engine of its own (its weights and its head), neither merged nor started where free form is refused.
    if artifact.manifest.free_form_version is not None and settings.free_form_answers:
        inner = artifact.free_form
        free_form.update(free_form_model_path=str(merged_model_dir(model.path, inner)),
                         free_form_artifact_path=str(inner.path))
    common["option_prefix_reuse"] = settings.option_prefix_reuse
    if engine.adapter_mode == "lora":  # one engine applies the adapter per request (vLLM's multi-LoRA kernels)
        return EngineConfig(**common, **lora, folded_model_path=folded, **free_form)
    return EngineConfig(**common, merged_model_path=str(merged_model_dir(model.path, artifact)) if adapter else None,
                        folded_model_path=folded, **free_form)


def offline_engines(settings=None):
    """The engine factory of offline scoring (`calm eval`, reports, the worker's judging): vLLM in process, with the
    gateway's engine settings where set (CALM_KV_CACHE_MB, CALM_ENGINE_START, ...), read through its own settings."""
    return partial(artifact_engine, overrides=(settings or gateway_settings()).engine_overrides())


def serving_default(settings, configured: Path) -> Path:
    """The folder of the version the registry serves by default: the configured artifact the first time it is seen,
    else what promotions and rollbacks left active (they survive restarts)."""
    from calm_core.registry import Registry
    from gateway.records.store import Store

    store = Store(settings.database)
    try:
        registry = Registry(store, settings.registry_root, settings.registry_url)
        return registry.path_of(registry.ensure_default(configured))
    finally:
        store.close()


def build_gateway(settings):
    """The FastAPI app for these settings, with its engine (in-process vLLM or upstream servers)."""
    from gateway.app import create_app

    stage(f"preparing the model ({settings.model or 'the embedded default'})")
    model = resolve_model(settings.model, "float32")
    configured = Path(settings.artifact) if settings.artifact else default_artifact(model)
    stage(f"loading the artifact {configured.name} and the served copies of its weights")
    artifact_path = serving_default(settings, configured)
    tokenizer, artifact = load_checked(model, artifact_path)
    if settings.engine is EngineKind.INPROCESS:
        engine = InProcessVLLMEngine(engine_config(settings, model, artifact_path, artifact, inprocess=True))

        def version_engine(path: Path, loaded):
            return InProcessVLLMEngine(engine_config(settings, model, path, loaded, inprocess=True))
    else:
        # The fleet's engines resolve every version by name in the shared registry (CALM_REGISTRY_DIR).
        engine = upstream_engine(settings, artifact)

        def version_engine(path: Path, loaded):
            return upstream_engine(settings, loaded)

    async def load_version(version: str, path: Path):
        """Another registry version's engine (per-domain versions, hot swap), started off the event loop; upstream,
        loaded and checked on every engine of the fleet before any route switches to it."""
        def build():
            _, loaded = load_checked(model, path, tokenizer)  # refuse a mismatched or corrupt one before any engine
            return version_engine(path, loaded), loaded

        started, loaded = await asyncio.to_thread(build)
        await started.start()
        prepare = getattr(started, "prepare", None)
        if prepare is not None:
            try:
                await prepare()
            except Exception:
                await started.close()
                raise
        return started, loaded

    return create_app(settings, engine, tokenizer, artifact, load_version=load_version)


def upstream_engine(settings, artifact):
    """A client of the fleet's vLLM servers that names this artifact version (its adapter and head) in every request;
    its free-form mode is loaded on the engines only where the gateway serves free form (CALM_ANSWERS)."""
    from adapters.clients.upstream import UpstreamVLLMEngine

    served = artifact.manifest.free_form_version is not None and settings.free_form_answers
    free_form = artifact.free_form if served else None
    return UpstreamVLLMEngine(
        settings.upstream_urls, settings.served_model_name, artifact.manifest.artifact_version, settings.max_model_len,
        settings.upstream_timeout_s, settings.upstream_connect_timeout_s, has_adapter=artifact.manifest.has_adapter,
        free_form_mode=free_form is not None, free_form_adapter=free_form is not None and free_form.manifest.has_adapter,
        engine_urls=settings.upstream_engine_urls or None, answer_timeout_s=settings.request_deadline_s,
        api_key=settings.upstream_api_key.get_secret_value() if settings.upstream_api_key is not None else None)


def engine_server_command(settings, host: str, port: int) -> tuple[list[str], dict[str, str], str]:
    """argv and environment for a vLLM OpenAI server with the α-head logits processor configured, and a line saying
    which memory allocator it runs on."""
    model = resolve_model(settings.model, "float32")
    artifact_path = Path(settings.artifact) if settings.artifact else default_artifact(model)
    _, artifact = load_checked(model, artifact_path)  # refuse a mismatch before a 30-second engine start
    cfg = engine_config(settings, model, artifact_path, artifact)
    env = {**os.environ, **cfg.env(), **RUNTIME_LORA_ENV}
    # Versions named per request are resolved in the gateways' registry (a shared volume on a fleet); vLLM checks them in
    # its API process, which sees the environment (not additional_config).
    env[REGISTRY_ENV] = os.environ.get(REGISTRY_ENV) or str(settings.registry_root)
    repo_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    allocator = "not preloaded: not a CPU engine"
    if cfg.engine.device == "cpu":
        env, allocator = with_allocator(env, settings.engine_allocator, tcmalloc_library())
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *cfg.server_args(host, port)], env, allocator
