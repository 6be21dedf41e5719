"""The α head's vLLM entry point (group `vllm.logits_processors`, pyproject.toml), for either model runner.

Installed as a plugin, it is loaded by every vLLM engine in the environment, CALM's or not. vLLM's V1 runner and its
Model Runner V2 each accept only a subclass of their own processor interface and build it with their own arguments,
so `AlphaHeadLogitsProcessor` subclasses every interface this vLLM has and hands back the implementation for the runner
that built it: adapters/vllm_plugins/alpha_v1.py (`(vllm_config, device, is_pin_memory)`) or adapters/vllm_plugins/alpha_v2.py
(`(vllm_config, req_states)`). Both read adapters/vllm_plugins/alpha_heads.py: the same heads, the same opt-out and the same
refusals (400s) on both runners.

A stock `vllm serve MODEL --logprobs-mode processed_logprobs --additional-config '{"calm_artifact": "/registry/V"}'`
serves that version's head, with no CALM launcher. A request opts out with `extra_args={"calm_alpha": False}` (HTTP:
`vllm_xargs`) or names another version with `extra_args={"calm_head": "VERSION"}`, looked up by name in the registry
folder ($CALM_REGISTRY_DIR or `additional_config["calm_registry"]`); a path, `..`, an unknown version or a corrupted
head is refused before the request reaches the engine.

Never fatal to an engine that is not CALM's: without CALM configuration the processor changes nothing, and if CALM's
own code fails to import here, an engine with no CALM configuration gets an inert processor (and a logged error),
while one configured for CALM refuses to start and says why.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_INTERFACES: list[type] = []  # the processor interfaces of the installed vLLM
try:  # V1 runner's; removed in vLLM 0.34
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1Interface

    _INTERFACES.append(V1Interface)
except ImportError:
    V1Interface = None
try:  # Model Runner V2's; from vLLM 0.32
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2Interface

    _INTERFACES.append(V2Interface)
except ImportError:
    V2Interface = None

# CALM's implementation for each runner this vLLM has; where ours fails to import, why (see _Inert).
_IMPLEMENTATIONS: dict[str, type] = {}
IMPORT_ERRORS: dict[str, str] = {}
if V1Interface is not None:
    try:
        from adapters.vllm_plugins.alpha_v1 import AlphaHeadV1

        _IMPLEMENTATIONS["v1"] = AlphaHeadV1
    except Exception as e:  # noqa: BLE001 - any failure of our code must leave a foreign engine running
        IMPORT_ERRORS["v1"] = f"{type(e).__name__}: {e}"
if V2Interface is not None:
    try:
        from adapters.vllm_plugins.alpha_v2 import AlphaHeadV2

        _IMPLEMENTATIONS["v2"] = AlphaHeadV2
    except Exception as e:  # noqa: BLE001
        IMPORT_ERRORS["v2"] = f"{type(e).__name__}: {e}"
for _runner, _error in IMPORT_ERRORS.items():
    logger.error("CALM's α-head plugin (%s runner) could not be imported (%s); engines with no CALM configuration are "
                 "unaffected", _runner, _error)

# What makes an engine CALM's (adapters/vllm_plugins/common.py's names, repeated so this module imports nothing of ours
# before the guarded import above).
_CALM_CONFIG_KEYS = ("calm_artifact", "calm_registry", "calm_core_share")
_CALM_REQUEST_KEYS = ("calm_alpha", "calm_head")


def _is_calm_engine(vllm_config) -> bool:
    extra = getattr(vllm_config, "additional_config", None)
    configured = isinstance(extra, dict) and any(k in extra for k in _CALM_CONFIG_KEYS)
    return configured or bool(os.environ.get("CALM_ARTIFACT"))


def _is_v2_call(runner_args: tuple) -> bool:
    """V2 builds a processor from (vllm_config, req_states), V1 from (vllm_config, device, is_pin_memory)."""
    return len(runner_args) == 1


class _Inert:
    """Leaves every logits row as it is, under either interface (only where CALM's code did not import)."""

    def __init__(self, *_):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def add_request(self, req_idx, sampling_params) -> bool:
        return False

    def apply_staged_writes(self) -> None:
        pass

    def apply(self, logits, ctx=None):
        return logits


_INERT = {"v1": type("InertAlphaHeadV1", (_Inert, V1Interface), {}) if V1Interface else None,
          "v2": type("InertAlphaHeadV2", (_Inert, V2Interface), {}) if V2Interface else None}


class AlphaHeadLogitsProcessor(*_INTERFACES):
    """What both of vLLM's loaders accept; an instance is the runner's implementation (see the module's docstring)."""

    def __new__(cls, vllm_config, *runner_args):
        runner = "v2" if _is_v2_call(runner_args) else "v1"
        if runner in _IMPLEMENTATIONS:
            return _IMPLEMENTATIONS[runner](vllm_config, *runner_args)
        if _is_calm_engine(vllm_config):
            raise RuntimeError(f"CALM's α-head plugin could not be imported for vLLM's {runner} model runner "
                               f"({IMPORT_ERRORS.get(runner)}); this engine is configured for CALM (calm_* in "
                               "--additional-config or $CALM_ARTIFACT)")
        return _INERT[runner](vllm_config, *runner_args)

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        # The front end validates for whichever runner the engine core uses; both implementations share one rule.
        implementation = next(iter(_IMPLEMENTATIONS.values()), None)
        if implementation is not None:
            implementation.validate_params(sampling_params)
        elif any(k in (sampling_params.extra_args or {}) for k in _CALM_REQUEST_KEYS):
            raise ValueError(f"this engine cannot apply CALM heads: its plugin could not be imported ({IMPORT_ERRORS})")
