"""Artifact versions' LoRA adapters loaded by a vLLM server at run time, by version name (a vLLM general plugin).

A fleet engine serves every version of the registry without a restart: a request whose `model` is a served name
("VERSION" or "VERSION:free_form", adapters/vllm_plugins/common.py's served_name) that the server has not loaded yet is resolved by
vLLM's run-time LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING, the resolvers of `vllm.lora.resolver`), and this
resolver maps the name to the adapter inside the registry folder ($CALM_REGISTRY_DIR): the same rule the α-head
processor uses for `calm_head`, so a request names a version, never a path, and a name outside the registry is a 404.
The engine loads the adapter before it runs the first request naming it, so an engine that restarts serves a version
only with that version's weights, whichever gateway replica or balancer sends the request.
Installed under vLLM's entry point group `vllm.general_plugins` (pyproject.toml): vLLM calls `register` in each of its
processes; only the API server consults resolvers.
"""

from __future__ import annotations

import asyncio

from adapters.vllm_plugins.common import served_adapter


def _resolver_class():
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class RegistryLoRAResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
            # Off the loop: with a registry URL (adapters/vllm_plugins/common.py) a version is fetched the first time.
            adapter = await asyncio.to_thread(served_adapter, lora_name)
            if adapter is None:
                return None
            # vLLM replaces the id (which must be > 0) with its own counter's next value before loading.
            return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=str(adapter))

    return RegistryLoRAResolver


def register() -> None:
    import vllm.envs as envs
    from vllm.lora.resolver import LoRAResolverRegistry

    if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        return  # vLLM consults resolvers only with run-time LoRA updating on
    LoRAResolverRegistry.register_resolver("calm-registry", _resolver_class()())
