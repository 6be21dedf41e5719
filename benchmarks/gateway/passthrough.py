"""A minimal pass-through proxy, the floor any gateway is compared with: it forwards /v1/chat/completions bodies to
one OpenAI-compatible upstream and relays the answer (streamed or not), nothing else. Same server stack as the
gateway (uvicorn, uvloop, httptools) and the same client (one pooled aiohttp session).

    python benchmarks/gateway/passthrough.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import sys

import aiohttp
import uvicorn

from instant_upstream import read_body  # same folder: run as a script

UPSTREAM = sys.argv[2].rstrip("/") if len(sys.argv) > 2 else "http://127.0.0.1:8000"
_session: aiohttp.ClientSession | None = None


async def app(scope, receive, send):
    global _session
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            if message["type"] == "lifespan.startup":
                _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))
                await send({"type": "lifespan.startup.complete"})
        await _session.close()
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})
        return
    body = await read_body(receive)
    async with _session.post(f"{UPSTREAM}{scope['path']}", data=body,
                             headers={"content-type": "application/json"}) as resp:
        kind = resp.headers.get("content-type", "application/json").encode()
        await send({"type": "http.response.start", "status": resp.status, "headers": [(b"content-type", kind)]})
        async for chunk in resp.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop="uvloop", http="httptools")
