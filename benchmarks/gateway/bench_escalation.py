"""What an escalate policy costs a confident answer: the same request under `annotate` and under `escalate` (its
threshold below the answer's confidence, so nothing is escalated), one after the other, in one run.

    python benchmarks/gateway/bench_escalation.py --out benchmarks/results [--pairs 1500]

The gateway (upstream mode, identity artifact) is pinned to core 0 in front of the instant stand-in upstream
(benchmarks/gateway/instant_upstream.py, core 1), so that the difference is the gateway's own code and not the engine's noise:
two domains, one per policy, the same chat question, answered as JSON and as a stream. Requests alternate in pairs
whose order alternates too (annotate first, then escalate first), one at a time from one keep-alive client on core 1.
Reported: the p50 of each and the added p50 (escalate - annotate), with the median of the paired differences. Under
escalate a stream is buffered until the decision (its first token comes with the whole answer), so the stream rows
compare the time to the whole answer. Results: escalation.json and escalation.md in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from gateway.settings import GatewaySettings  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

MODEL = GatewaySettings.model_fields["served_model_name"].default
ADMIN = {"Authorization": "Bearer dev-admin-key"}
POLICIES = {
    "annotated": {"threshold": 0.1, "action": "annotate"},
    # The instant upstream answers at confidence exp(-0.5) = 0.61: above 0.1, never escalated. The target is never
    # called (a closed port: a call would show up as a fallback in the check below).
    "escalated": {"threshold": 0.1, "action": "escalate", "escalate": {"target": "closed", "model": "strong",
                                                                       "timeout_s": 5}},
}


def body(domain: str, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0, "stream": stream, "metadata": {"domain": domain}}


def timed(client: httpx.Client, url: str, domain: str, stream: bool) -> float:
    started = time.perf_counter()
    response = client.post(f"{url}/v1/chat/completions", json=body(domain, stream))
    elapsed = time.perf_counter() - started
    compact = response.text.replace(" ", "")
    if response.status_code != 200 or '"escalated":true' in compact or '"fallback":"' in compact:
        raise SystemExit(f"unexpected answer for {domain}: {response.status_code} {response.text[:300]}")
    return elapsed * 1000


def measure(url: str, pairs: int, stream: bool) -> dict:
    latency: dict[str, list[float]] = {d: [] for d in POLICIES}
    with httpx.Client(timeout=30) as client:
        for _ in range(100):  # warm-up: caches, the first policy reads, connection set-up
            for domain in POLICIES:
                timed(client, url, domain, stream)
        for i in range(pairs):
            order = list(POLICIES) if i % 2 == 0 else list(reversed(POLICIES))
            for domain in order:
                latency[domain].append(timed(client, url, domain, stream))
    a, e = latency["annotated"], latency["escalated"]
    return {"annotate_p50_ms": statistics.median(a), "escalate_p50_ms": statistics.median(e),
            "added_p50_ms": statistics.median(e) - statistics.median(a),
            "paired_median_ms": statistics.median(y - x for x, y in zip(a, e)),
            "annotate_p90_ms": statistics.quantiles(a, n=10)[-1], "escalate_p90_ms": statistics.quantiles(e, n=10)[-1],
            "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--pairs", type=int, default=1500)
    args = parser.parse_args()
    logs = REPO / "benchmarks" / "results" / "logs" / "escalation"
    logs.mkdir(parents=True, exist_ok=True)
    from training.artifacts import write_identity_artifact

    identity = logs / "identity"
    if not identity.is_dir():
        write_identity_artifact(identity, with_reference=False)
    port, gw = free_port(), free_port()
    upstream, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{gw}"
    env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": json.dumps([upstream]), "CALM_ARTIFACT": str(identity),
           "CALM_DB_PATH": str(logs / "gateway.sqlite3"), "CALM_DOMAINS": json.dumps(list(POLICIES)),
           "CALM_TARGETS": json.dumps({"closed": {"url": "http://127.0.0.1:9/v1", "private": True}})}
    (logs / "gateway.sqlite3").unlink(missing_ok=True)
    results = {}
    with ExitStack() as stack:
        stack.enter_context(running(["taskset", "-c", "1", sys.executable,
                                     str(REPO / "benchmarks" / "gateway" / "instant_upstream.py"), str(port)],
                                    f"{upstream}/health", logs / "instant.log"))
        stack.enter_context(running(["taskset", "-c", "0", *calm_argv("serve", "--port", str(gw))], f"{url}/health",
                                    logs / "gateway.log", env=env))
        for domain, policy in POLICIES.items():
            httpx.put(f"{url}/admin/policies/{domain}", json=policy, headers=ADMIN).raise_for_status()
        for stream in (False, True):
            name = "stream" if stream else "json"
            results[name] = measure(url, args.pairs, stream)
            print(name, json.dumps(results[name]), flush=True)
        metrics = httpx.get(f"{url}/metrics").text
    if "calm_escalations_total{" in metrics:
        raise SystemExit("an answer was escalated: the benchmark measured something else")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "escalation.json").write_text(json.dumps(results, indent=2))
    (args.out / "escalation.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    pairs = r["json"]["pairs"]
    lines = [f"`python benchmarks/gateway/bench_escalation.py` (one run, {pairs} request pairs per row, the gateway on one core in "
             "front of an instant upstream, one request at a time; nothing escalated):", "",
             "| response | annotate p50 | escalate p50 | added p50 | median paired difference | annotate p90 | escalate p90 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, label in (("json", "JSON"), ("stream", "stream (escalate: buffered)")):
        x = r[name]
        lines.append(f"| {label} | {x['annotate_p50_ms']:.2f} ms | {x['escalate_p50_ms']:.2f} ms | "
                     f"{x['added_p50_ms']:+.2f} ms | {x['paired_median_ms']:+.2f} ms | {x['annotate_p90_ms']:.2f} ms | "
                     f"{x['escalate_p90_ms']:.2f} ms |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
