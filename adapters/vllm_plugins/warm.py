"""vLLM server middleware: an engine that (re)starts loads the versions the gateways serve before it takes traffic.

    vllm serve MODEL ... --middleware adapters.vllm_plugins.warm.ServedVersionsFirst

Until the versions of the registry folder's serving list ($CALM_REGISTRY_DIR/serving.json, which the gateways keep,
calm_core/registry.py) are loaded, the server's `/health` answers 503, so a balancer that health-checks `/health`
(deploy/haproxy, a Kubernetes readiness probe) sends it no request before then. Loading is the gateways' own check
(adapters/clients/upstream.py `prepare`) made from inside the server: one one-token completion per served name, the version's
adapter as `model` (vLLM's run-time LoRA loading, adapters/vllm_plugins/lora_resolver.py) and its head as `calm_head`. A version
that cannot be loaded is logged and skipped: the engine still comes up, and a request naming it is refused as it would
be anyway. Requests sent to the engine directly meanwhile are served as always (each loads its version first).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from adapters.vllm_plugins.common import (FREE_FORM_DIR, HEAD_ARG_KEY, REGISTRY_URL_ENV, registry_folder, resolve_version,
                                  served_adapter, served_name)
from calm_core.registry import SERVED_FILE, read_served, served_versions
from calm_core.registry_mirror import MirrorError, RegistryMirror

log = logging.getLogger("calm.engine")


def served_names(root: Path, versions: Iterable[str]) -> list[str]:
    """Every name the engine serves the versions by: each version, and its free-form mode where it has one."""
    names = []
    for version in versions:
        names.append(served_name(version))
        try:
            folder = resolve_version(version)  # fetched from the registry URL where the engine has one
        except ValueError:
            folder = root / version
        if (folder / FREE_FORM_DIR).is_dir():
            names.append(served_name(version, free_form=True))
    return names


def served_list(root: Path) -> list[str]:
    """The gateways' serving list: in the registry folder, or at the registry URL where the engine has one."""
    url = os.environ.get(REGISTRY_URL_ENV)
    if not url:
        return read_served(root)
    try:
        return served_versions(RegistryMirror(url).read_text(SERVED_FILE))
    except (OSError, MirrorError):
        return []


def server_key(scope: dict) -> str | None:
    """The key this server requires on /v1 (vLLM's --api-key, which takes precedence, else VLLM_API_KEY, as vLLM reads
    them): the requests below pass through vLLM's authentication like any other."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    return next((key for key in keys if key), None)


async def call(app, scope: dict, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """One request through the ASGI app inside this process (`scope`: a request's, for the app and its state)."""
    payload = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if key := server_key(scope):
        headers.append((b"authorization", f"Bearer {key}".encode()))
    inner = {**scope, "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers}
    delivered, status, chunks = False, 0, []

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()  # the caller never leaves; the app cancels this listener when it is done
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(inner, receive, send)
    return status, b"".join(chunks)


class ServedVersionsFirst:
    def __init__(self, app, root: str | None = None):
        self.app = app
        self.root = Path(root) if root else registry_folder()
        self.loaded: list[str] = []  # served names loaded so far
        self.failed: dict[str, str] = {}  # served name -> why it could not be loaded
        self._loading: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.root is None or (self._loading is not None and self._loading.done())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/health" or self.ready:
            return await self.app(scope, receive, send)
        if self._loading is None:
            self._loading = asyncio.get_running_loop().create_task(self._load_all(dict(scope)))
            await asyncio.wait([self._loading], timeout=1.0)  # a short list is loaded before this check answers
            if self.ready:
                return await self.app(scope, receive, send)
        body = json.dumps({"status": "loading the served versions", "loaded": self.loaded}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})

    async def _load_all(self, scope: dict) -> None:
        try:
            # Off the loop: with a registry URL the list and the versions are fetched over the network.
            names = await asyncio.to_thread(lambda: served_names(self.root, served_list(self.root)))
            if not names:
                return
            status, body = await call(self.app, scope, "GET", "/v1/models")
            base = next(m["id"] for m in json.loads(body)["data"] if not m.get("parent"))
            for name in names:
                model = name if served_adapter(name) is not None else base
                status, body = await call(self.app, scope, "POST", "/v1/completions", {
                    "model": model, "prompt": [1], "max_tokens": 1, "vllm_xargs": {HEAD_ARG_KEY: name}})
                if status == 200:
                    self.loaded.append(name)
                else:
                    self.failed[name] = body.decode(errors="replace")[:300]
                    log.error("served version %s could not be loaded (%s): %s", name, status, self.failed[name])
            log.info("loaded the served versions before taking traffic: %s", ", ".join(self.loaded) or "none")
        except Exception as e:  # noqa: BLE001 - the engine comes up regardless; each request loads its version
            log.error("could not load the served versions: %s: %s", type(e).__name__, e)
