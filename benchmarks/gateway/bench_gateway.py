"""Gateway overhead, α-head cost and the gateway's own ceiling, measured side by side in one run.

    python benchmarks/gateway/bench_gateway.py --out benchmarks/results

1. A vLLM server with the α head (`calm engine`) is called directly and through the gateway (upstream mode), with the
   same model and prompts, at concurrency 1, 8 and 32: throughput ratio and added median latency. Multiple choice is
   measured with the gateway's default (raw_confidence on: one more engine row per request) and with it off.
2. The same server with and without the α-head logits processor: decode time of free-form answers.
3. The gateway pinned to one core against an instant stand-in upstream: requests per second.
Results: gateway.json and gateway.md in --out. All processes run on this machine, so on a 2-core box the gateway
and the engine compete for the same cores: read the ratios with that in mind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adapters.clients.upstream import _payload  # noqa: E402  (the exact body the gateway sends upstream)
from calm_core.engine import EngineRequest  # noqa: E402
from calm_cli.serving import engine_server_command  # noqa: E402
from calm_core.data import load_mc  # noqa: E402
from calm_core.prompts import letter_token_ids, letter_user_message, render_chat  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

MODEL = "calm-smollm2-135m"
CONCURRENCY = (1, 8, 32)
FREE_TOKENS = 32


async def load(send, bodies: list[dict], concurrency: int) -> dict:
    """Send every body with at most `concurrency` in flight; per-request latency and overall throughput."""
    latencies: list[float] = []
    queue = list(bodies)

    async def worker(client):
        while queue:
            body = queue.pop()
            start = time.perf_counter()
            await send(client, body)
            latencies.append(time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"n": len(latencies), "rps": len(latencies) / elapsed, "p50_ms": 1000 * statistics.median(latencies),
            "p90_ms": 1000 * statistics.quantiles(latencies, n=10)[-1]}


def make_sender(url: str):
    async def send(client: httpx.AsyncClient, body: dict):
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for _ in r.aiter_bytes():
                pass
    return send


def level(runs: dict[str, tuple[str, list[dict]]], concurrency: int) -> dict:
    """One concurrency level: each named run's bodies sent to its URL, one run after the other; printed as it lands."""
    row = {name: asyncio.run(load(make_sender(url), bodies, concurrency)) for name, (url, bodies) in runs.items()}
    print(f"concurrency {concurrency}: " + ", ".join(f"{k} {v['rps']:.2f} rps p50 {v['p50_ms']:.0f} ms"
                                                   for k, v in row.items()), flush=True)
    return row


def workloads(tokenizer, n: int):
    questions = [q for q in load_mc("arc_easy", "dev") if q.n_options == 4][:n]
    letter_ids = tuple(letter_token_ids(tokenizer)[:4])
    direct_mc, gw_mc, gw_mc_noraw, direct_ff, gw_ff = [], [], [], [], []
    for i, q in enumerate(questions):
        prompt = render_chat(tokenizer, [{"role": "user", "content": letter_user_message(q.question, q.choices)}])
        direct_mc.append(_payload(MODEL, None, EngineRequest(str(i), prompt, max_tokens=1, option_token_ids=letter_ids)))
        gw = {"model": MODEL, "messages": [{"role": "user", "content": q.question}], "options": list(q.choices),
              "metadata": {"domain": "science"}}
        gw_mc.append(gw)
        gw_mc_noraw.append({**gw, "calm": {"raw_confidence": False}})
        ff_messages = [{"role": "user", "content": f"Explain briefly: {q.question}"}]
        ff_prompt = render_chat(tokenizer, ff_messages)
        # Greedy on both paths, so both produce the same tokens and stop at the same place.
        direct_ff.append(_payload(MODEL, None, EngineRequest(str(i), ff_prompt, max_tokens=FREE_TOKENS, top_logprobs=5)))
        gw_ff.append({"model": MODEL, "messages": ff_messages, "max_tokens": FREE_TOKENS, "stream": True})
    return direct_mc, gw_mc, gw_mc_noraw, direct_ff, gw_ff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)

    from transformers import AutoTokenizer

    from calm_core.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    direct_mc, gw_mc, gw_mc_noraw, direct_ff, gw_ff = workloads(tokenizer, args.requests)
    # An identity letter-format head, so that the gateway and the direct calls score options the same way (the shipped
    # artifact scores by cloze: benchmarks/scoring/bench_cloze_serving.py measures that path).
    from training.artifacts import write_identity_artifact

    identity = logs / "identity-artifact"
    write_identity_artifact(identity, None, with_reference=False)
    # The engine and the gateway share one registry folder: the gateway names its version, the engine resolves it there.
    registry = logs / "registry"
    os.environ["CALM_REGISTRY_DIR"] = str(registry)
    settings = GatewaySettings(artifact=str(identity), registry_dir=registry)
    results: dict = {"requests_per_level": args.requests, "free_form_tokens": FREE_TOKENS, "cpus": os.cpu_count()}

    def engine(alpha: bool, port: int):
        argv, env, _ = engine_server_command(settings, "127.0.0.1", port)
        if not alpha:  # no artifact configured: the α-head plugin changes nothing
            i = argv.index("--additional-config")
            argv, env = argv[:i] + argv[i + 2:], {k: v for k, v in env.items() if k != "CALM_ARTIFACT"}
        return running(argv, f"http://127.0.0.1:{port}/health", logs / f"engine-{'alpha' if alpha else 'plain'}.log",
                       env=env, timeout=300)

    # 1 + 2a: engine with the α head, direct and through the gateway.
    e_port, g_port = free_port(), free_port()
    direct_url = f"http://127.0.0.1:{e_port}/v1/completions"
    gw_url = f"http://127.0.0.1:{g_port}/v1/chat/completions"
    gw_env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": json.dumps([f"http://127.0.0.1:{e_port}"]),
              "CALM_DB_PATH": str(args.out / "logs" / "bench.sqlite3"), "CALM_ARTIFACT": str(identity)}
    with engine(True, e_port), running(calm_argv("serve", "--port", str(g_port)), f"http://127.0.0.1:{g_port}/health",
                                       logs / "gateway.log", env=gw_env):
        # Warm-up: every prompt once, so the rows compared, which run one after the other, all find their questions in
        # vLLM's prefix cache (not only the later ones); then the gateway.
        asyncio.run(load(make_sender(direct_url), direct_mc + [{**b, "max_tokens": 1} for b in direct_ff], 8))
        asyncio.run(load(make_sender(gw_url), gw_mc[:8], 8))
        for c in CONCURRENCY:
            results[f"c{c}"] = level({"mc_direct": (direct_url, direct_mc), "mc_gateway": (gw_url, gw_mc),
                                      "mc_gateway_no_raw": (gw_url, gw_mc_noraw), "ff_direct": (direct_url, direct_ff),
                                      "ff_gateway": (gw_url, gw_ff)}, c)
        results["decode_alpha"] = asyncio.run(load(make_sender(direct_url), direct_ff, 8))

    # 2b: the same engine without the α head.
    p_port = free_port()
    with engine(False, p_port):
        url = f"http://127.0.0.1:{p_port}/v1/completions"
        asyncio.run(load(make_sender(url), direct_ff[:8], 8))
        results["decode_plain"] = asyncio.run(load(make_sender(url), direct_ff, 8))
    print(f"decode with α head {results['decode_alpha']['rps']:.2f} rps, without {results['decode_plain']['rps']:.2f} rps", flush=True)

    # 3: the gateway's own ceiling on one core against an instant upstream.
    i_port, c_port = free_port(), free_port()
    instant = [sys.executable, str(Path(__file__).with_name("instant_upstream.py")), str(i_port)]
    ceiling_env = {**gw_env, "CALM_UPSTREAM_URLS": json.dumps([f"http://127.0.0.1:{i_port}"])}
    with running(["taskset", "-c", "1", *instant], f"http://127.0.0.1:{i_port}/health", logs / "instant.log"), \
         running(["taskset", "-c", "0", *calm_argv("serve", "--port", str(c_port))], f"http://127.0.0.1:{c_port}/health",
                 logs / "gateway-ceiling.log", env=ceiling_env):
        url = f"http://127.0.0.1:{c_port}/v1/chat/completions"
        noraw = [{**b, "calm": {"raw_confidence": False}} for b in gw_mc]
        asyncio.run(load(make_sender(url), noraw[:32], 8))
        results["ceiling"] = asyncio.run(load(make_sender(url), noraw * 8, 32))
    print(f"gateway ceiling (one core, instant upstream): {results['ceiling']['rps']:.0f} rps", flush=True)

    (args.out / "gateway.json").write_text(json.dumps(results, indent=2))
    (args.out / "gateway.md").write_text(markdown(results))
    print(markdown(results))


def ratio_rows(r: dict, workloads: tuple[tuple[str, str, str], ...], added: bool = False) -> list[str]:
    """Table rows per concurrency level and (name, direct key, other key): both paths' rps, their ratio and p50s (and
    the p50 the other path adds, with `added`)."""
    lines = []
    for c in CONCURRENCY:
        row = r[f"c{c}"]
        for name, direct, other in workloads:
            d, g = row[direct], row[other]
            lines.append(f"| {name} | {c} | {d['rps']:.2f} | {g['rps']:.2f} | {g['rps'] / d['rps']:.3f} | "
                         f"{d['p50_ms']:.1f} | {g['p50_ms']:.1f} |" + (f" {g['p50_ms'] - d['p50_ms']:+.1f} |" if added else ""))
    return lines


def markdown(r: dict) -> str:
    lines = [
        f"Gateway + vLLM (`calm engine`, upstream mode) against the same vLLM server called directly; {r['requests_per_level']} "
        f"requests per level, {r['cpus']} CPUs shared by engine, gateway and load generator. Free form: {r['free_form_tokens']} tokens.",
        "",
        "| workload | concurrency | direct rps | gateway rps | ratio | direct p50 ms | gateway p50 ms | added p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += ratio_rows(r, (("multiple choice", "mc_direct", "mc_gateway"),
                            ("multiple choice, raw_confidence off", "mc_direct", "mc_gateway_no_raw"),
                            ("free form", "ff_direct", "ff_gateway")), added=True)
    a, p = r["decode_alpha"], r["decode_plain"]
    lines += ["", f"α head in the engine (free form, concurrency 8): {a['rps']:.2f} rps with it, {p['rps']:.2f} without "
              f"→ decode time {100 * (p['rps'] / a['rps'] - 1):+.1f} % with the head (run-to-run noise is larger than that).",
              f"Gateway ceiling, pinned to one core, instant upstream, concurrency 32: {r['ceiling']['rps']:.0f} requests/s "
              f"(p50 {r['ceiling']['p50_ms']:.1f} ms)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
