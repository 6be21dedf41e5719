"""Engine settings and names shared by the in-process engine and the `calm engine` server, so both calibrate identically."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from adapters.hosting.engine_settings import EngineOverrides, EngineSettings, resolve
from calm_core.artifact import ADAPTER_DIR, FREE_FORM_DIR, VERSION_NAME
from calm_core.paths import calm_home
from calm_core.registry_mirror import MirrorError, RegistryMirror

# Names shared with the logits processor; kept here so HTTP clients need no vLLM import.
ARTIFACT_ENV = "CALM_ARTIFACT"
ARTIFACT_CONFIG_KEY = "calm_artifact"  # in vLLM's additional_config: the head of one engine
OPT_OUT_KEY = "calm_alpha"
HEAD_ARG_KEY = "calm_head"  # in a request's extra_args: apply this artifact version's head instead of the engine's
# Where versions named by `calm_head` are looked up: the registry's folder (a shared volume on a fleet). The engine
# reads $CALM_REGISTRY_DIR, or `calm_registry` in its additional_config; a request names a version, never a path.
REGISTRY_ENV = "CALM_REGISTRY_DIR"
REGISTRY_CONFIG_KEY = "calm_registry"
# Where the registry lives when the fleet's machines share no volume (s3://bucket/prefix, any fsspec URL): a version
# named by a request is fetched from there into $CALM_REGISTRY_DIR (default $CALM_HOME/registry) and checked against
# its index the first time (calm_core/registry_mirror.py).
REGISTRY_URL_ENV = "CALM_REGISTRY_URL"
# A version's free-form mode (its own adapter and head, calm_core/artifact.FREE_FORM_DIR) is served as "VERSION:free_form".
FREE_FORM_SUFFIX = ":" + FREE_FORM_DIR
# A fleet engine loads versions' adapters at run time (adapters/vllm_plugins/lora_resolver.py): vLLM consults resolvers only
# with this in the server's environment.
RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
MULTI_LORA_RANK = 64  # rank room of an engine that serves every version's adapter (or more, for a larger adapter)
# Also installed as vLLM's plugin (entry point group `vllm.logits_processors`, pyproject.toml): a stock `vllm serve`
# in this environment loads it without --logits-processors.
LOGITS_PROCESSOR = "adapters.vllm_plugins.alpha:AlphaHeadLogitsProcessor"
# In-process CPU engines size their OpenMP teams step by step (adapters/hosting/core_share.py), configured by this key.
CORE_SHARE_PROCESSOR = "adapters.vllm_plugins.core_share:CoreShareLogitsProcessor"
CORE_SHARE_KEY = "calm_core_share"
WARM_MIDDLEWARE = "adapters.vllm_plugins.warm.ServedVersionsFirst"
ADAPTER_NAME = "calm-adapter"  # prefix of a version's LoRA request in an in-process multi-LoRA engine
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts for max_lora_rank
MAX_LORAS = 4  # adapters resident at once in a multi-LoRA engine (more versions: vLLM swaps them in per batch)


# Registry folders this process knows (the in-process engines register theirs), beside $CALM_REGISTRY_DIR: request
# validation runs in the front-end process, which has the engine's environment but not its additional_config.
_ROOTS: set[Path] = set()


def additional_config(vllm_config) -> dict:
    """An engine's `additional_config` (where CALM's plugins read their settings), {} where none was given (vLLM
    leaves None, or a non-dict from a stock command line)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra if isinstance(extra, dict) else {}


def register_registry_root(path: str | Path) -> None:
    _ROOTS.add(Path(path).resolve())


def registry_folder() -> Path | None:
    """This engine's registry folder from its environment (with a registry URL and no folder: $CALM_HOME/registry)."""
    if os.environ.get(REGISTRY_ENV):
        return Path(os.environ[REGISTRY_ENV]).resolve()
    if os.environ.get(REGISTRY_URL_ENV):
        return (calm_home() / "registry").resolve()
    return None


def _roots(extra: dict | None = None) -> list[Path]:
    roots = set(_ROOTS)
    for root in ((extra or {}).get(REGISTRY_CONFIG_KEY), registry_folder()):
        if root:
            roots.add(Path(root).resolve())
    return sorted(roots)


def _version_in(root: Path, version: str) -> Path | None:
    """The version's folder inside `root`; fetched from the registry URL first where the engine has one."""
    folder = root / version
    url = os.environ.get(REGISTRY_URL_ENV)
    if url and not folder.is_dir() and root == registry_folder():
        try:
            RegistryMirror(url).download(version, root)  # only on a miss: each version once
        except MirrorError as e:
            raise ValueError(f"extra_args[{HEAD_ARG_KEY!r}]: version {version!r}: {e}") from None
    return folder if folder.is_dir() and folder.resolve().parent == root else None


def served_name(version: str, free_form: bool = False) -> str:
    """The name a fleet engine knows a version's mode by: its LoRA adapter's model name and its head's `calm_head`."""
    return version + FREE_FORM_SUFFIX if free_form else version


def resolve_version(name: object, extra: dict | None = None) -> Path:
    """The folder of an artifact version (or of its free-form mode, "VERSION:free_form") named by a request, inside a
    registry folder; ValueError otherwise."""
    version = name[: -len(FREE_FORM_SUFFIX)] if isinstance(name, str) and name.endswith(FREE_FORM_SUFFIX) else name
    if not isinstance(version, str) or not re.fullmatch(VERSION_NAME, version):
        raise ValueError(f"extra_args[{HEAD_ARG_KEY!r}] must be an artifact version name (letters, digits, '.', '_', "
                         f"'-', optionally followed by {FREE_FORM_SUFFIX!r}), not a path")
    for root in _roots(extra):
        folder = _version_in(root, version)
        if folder is not None:
            if version == name:
                return folder
            if (folder / FREE_FORM_DIR).is_dir():
                return folder / FREE_FORM_DIR
            raise ValueError(f"extra_args[{HEAD_ARG_KEY!r}]: version {version!r} has no free-form mode")
    raise ValueError(f"extra_args[{HEAD_ARG_KEY!r}]: no artifact version {version!r} in this engine's registry "
                     f"(${REGISTRY_ENV})")


def served_adapter(name: str) -> Path | None:
    """The LoRA adapter folder of a served name, or None when it names nothing in the registry or has no adapter."""
    try:
        folder = resolve_version(name)
    except ValueError:
        return None
    adapter = folder / ADAPTER_DIR
    return adapter if (adapter / "adapter_config.json").is_file() else None


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    artifact_path: str
    served_model_name: str = "calm"
    engine: EngineSettings = field(default_factory=lambda: resolve(EngineOverrides(device="cpu")))
    max_model_len: int = 2048
    max_logprobs: int = 20
    seed: int = 0
    adapter_path: str | None = None  # the artifact's LoRA adapter, applied per request (vLLM LoRA; server, CUDA)
    adapter_rank: int = 0
    merged_model_path: str | None = None  # base + adapter merged: a second engine for adapter requests (in-process)
    folded_model_path: str | None = None  # merged + α scales folded into the LM head: one-pass scoring (in-process)
    # Free-form answers from the artifact's free-form mode: its weights (adapter merged) and its own α head
    # (in-process: an engine of its own, since a logits processor holds one head per engine).
    free_form_model_path: str | None = None
    free_form_artifact_path: str | None = None
    # False where the gateway refuses free-form requests (CALM_ANSWERS=multiple_choice): no engine is kept for them.
    free_form_answers: bool = True
    registry_dir: str | None = None  # where versions named per request are looked up (a fleet's shared registry)
    option_prefix_reuse: bool = True  # one-pass options read the question's cached blocks (needs prefix caching)

    @property
    def registry_root(self) -> str:
        """Where a multi-LoRA or fleet engine looks up versions by name: the registry, else the artifact's folder."""
        return self.registry_dir or os.path.dirname(os.path.abspath(self.artifact_path))

    @property
    def version_name(self) -> str:
        return os.path.basename(os.path.abspath(self.artifact_path))

    @property
    def max_lora_rank(self) -> int:
        return next(r for r in LORA_RANKS if r >= self.adapter_rank)

    def env(self) -> dict[str, str]:
        """Environment the engine (and its worker processes) needs."""
        return {
            ARTIFACT_ENV: os.path.abspath(self.artifact_path),
            "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
            **self.engine.env(),
        }

    def engine_kwargs(self, model_path: str | None = None, lora: bool = False, artifact_path: str | None = None) -> dict:
        """In-process engine arguments; an adapter is served there from merged weights (`merged_model_path`) or, with
        `lora`, by vLLM's LoRA kernels in this engine (`adapter_path`). The α head is the artifact's unless another
        artifact is named (the free-form engine's)."""
        kwargs = dict(
            model=model_path or self.model_path,
            # Every engine of a process reads the tokenizer from the base model's folder (merged and folded copies hold
            # the same files): vLLM caches it by path, so an engine started for a promoted version loads none. A load
            # holds the GIL for most of a second and stalled the gateway's requests (benchmarks/engines/bench_hot_swap.py).
            tokenizer=self.model_path,
            served_model_name=[self.served_model_name],
            max_model_len=self.max_model_len,
            max_logprobs=self.max_logprobs,
            # Returned log-probs must be the calibrated ones, i.e. taken after our logits processor.
            logprobs_mode="processed_logprobs",
            logits_processors=[LOGITS_PROCESSOR],
            seed=self.seed,
            # Versions named per request (multi-LoRA) sit beside this one in the registry folder.
            additional_config={ARTIFACT_CONFIG_KEY: os.path.abspath(artifact_path or self.artifact_path),
                               REGISTRY_CONFIG_KEY: self.registry_root},
            **self.engine.vllm_kwargs(),
        )
        if lora:  # one multi-LoRA engine for every version in this process: rank up to 64 (or this adapter's)
            kwargs.update(enable_lora=True, max_lora_rank=max(self.max_lora_rank, MULTI_LORA_RANK), max_loras=MAX_LORAS)
        return kwargs

    def server_args(self, host: str, port: int) -> list[str]:
        """Stock `vllm serve` flags: the α head comes from the plugin entry point, configured by --additional-config
        (what a platform that starts vLLM itself passes too; docs/engines.md)."""
        additional = {ARTIFACT_CONFIG_KEY: os.path.abspath(self.artifact_path), REGISTRY_CONFIG_KEY: self.registry_root}
        args = [
            "--model", self.model_path,
            "--served-model-name", self.served_model_name,
            *self.engine.server_args(),
            "--max-model-len", str(self.max_model_len),
            "--max-logprobs", str(self.max_logprobs),
            "--logprobs-mode", "processed_logprobs",
            # A request's sampling parameters are the caller's or vLLM's "off" values, never the model's
            # generation_config.json defaults (a repetition penalty there would reach every confidence).
            "--generation-config", "vllm",
            "--additional-config", json.dumps(additional),
            "--seed", str(self.seed),
            "--host", host,
            "--port", str(port),
        ]
        # Every version's adapter is loaded at run time by name (adapters/vllm_plugins/lora_resolver.py), so LoRA is always on.
        args += ["--enable-lora", "--max-lora-rank", str(max(self.max_lora_rank, MULTI_LORA_RANK)),
                 "--max-loras", str(MAX_LORAS)]
        # A restarted engine's /health waits until the versions the gateways serve are loaded (adapters/vllm_plugins/warm.py).
        args += ["--middleware", WARM_MIDDLEWARE]
        return args
