"""What the Responses API costs next to chat completions on the same gateway: the same question through both, whole
and streamed, at the gateway's ceiling and one at a time, in one run with the four interleaved.

    python benchmarks/gateway/bench_responses_api.py [--rounds N] [--seconds S] [--out DIR]

The gateway (identity artifact) is pinned to core 0 in front of the instant stand-in upstream on core 1
(benchmarks/gateway/instant_upstream.py), as in bench_lean.py's ceiling, so only the gateway's own work is measured: a
response is the chat completion written as a response object, a stream the chat stream's chunks re-read and written
as the Responses API's events. wrk (Debian) drives each workload with 32 connections, rounds in a rotating order, then
one connection for the latency alone. Results: responses_api.json and responses_api.md in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gateway.bench_lean import MAX_TOKENS, MODEL, WRK_SCRIPT, run_wrk, upstream_gateway_env, wrk_binary  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

QUESTION = "What is the capital of France?"
WORKLOADS = {  # name: (path, body)
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                      "max_tokens": MAX_TOKENS, "temperature": 0}),
    "responses": ("/v1/responses", {"model": MODEL, "input": QUESTION, "max_output_tokens": MAX_TOKENS,
                                    "temperature": 0}),
    "chat, streamed": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                                "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}),
    "responses, streamed": ("/v1/responses", {"model": MODEL, "input": QUESTION, "max_output_tokens": MAX_TOKENS,
                                              "temperature": 0, "stream": True}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=8)
    args = parser.parse_args()
    wrk_binary()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from training.artifacts import write_identity_artifact

    identity = logs / "identity-artifact"
    if not identity.exists():
        write_identity_artifact(identity, None, with_reference=False)
    scripts = {}
    for name, (_, body) in WORKLOADS.items():
        scripts[name] = logs / f"responses-api-{name.replace(', ', '-')}.lua"
        scripts[name].write_text(WRK_SCRIPT.format(body=json.dumps(body), key="unused"))
    names = list(WORKLOADS)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    alone: dict[str, list[float]] = {n: [] for n in names}
    with ExitStack() as stack:
        port, gw = free_port(), free_port()
        upstream = f"http://127.0.0.1:{port}"
        stack.enter_context(running(["taskset", "-c", "1", sys.executable,
                                     str(REPO / "benchmarks" / "gateway" / "instant_upstream.py"), str(port)],
                                    f"{upstream}/health", logs / "instant.log"))
        url = f"http://127.0.0.1:{gw}"
        stack.enter_context(running(["taskset", "-c", "0", *calm_argv("serve", "--port", str(gw))], f"{url}/health",
                                    logs / "gateway-responses-api.log",
                                    env=upstream_gateway_env(upstream, logs, "responses-api", identity)))
        for name in names:  # warm-up; every answer must be a 200
            warm = run_wrk(url, scripts[name], 2, 8, WORKLOADS[name][0])
            assert warm["non_2xx"] == 0 and warm["rps"] > 0, (name, warm)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                runs[name].append(run_wrk(url, scripts[name], args.seconds, 32, WORKLOADS[name][0]))
                alone[name].append(run_wrk(url, scripts[name], max(args.seconds // 2, 3), 1, WORKLOADS[name][0])["p50_ms"])
                print(f"round {r + 1}: {name} {runs[name][-1]['rps']:.0f} rps, alone p50 {alone[name][-1]:.2f} ms",
                      flush=True)
    results = {"measured_at": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds, "seconds": args.seconds,
               "max_tokens": MAX_TOKENS, "workloads": {}}
    for name in names:
        results["workloads"][name] = {
            "rps": statistics.median(x["rps"] for x in runs[name]), "p50_ms": statistics.median(x["p50_ms"] for x in runs[name]),
            "c1_p50_ms": statistics.median(alone[name]), "non_2xx": sum(x["non_2xx"] for x in runs[name]), "runs": runs[name]}
    (args.out / "responses_api.json").write_text(json.dumps(results, indent=2))
    (args.out / "responses_api.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    w = r["workloads"]
    lines = [f"`python benchmarks/gateway/bench_responses_api.py` ({r['measured_at']}): the same question ({r['max_tokens']} "
             "tokens, greedy) through one gateway pinned to one core, in front of an instant upstream; wrk, 32 "
             f"connections, {r['rounds']} interleaved rounds of {r['seconds']} s (median), then one connection alone.",
             "", "| workload | requests/s | ratio to chat (same streaming) | p50 ms | p50 ms alone | added p50 ms alone |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, x in w.items():
        base = w["chat, streamed" if "streamed" in name else "chat"]
        lines.append(f"| {name} | {x['rps']:.0f} | {x['rps'] / base['rps']:.3f} | {x['p50_ms']:.1f} | "
                     f"{x['c1_p50_ms']:.2f} | {x['c1_p50_ms'] - base['c1_p50_ms']:+.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
