"""Throughput of the fleet against its engines called directly, side by side in one run.

    python benchmarks/gateway/bench_fleet.py --out benchmarks/results

The fleet of tests/test_fleet.py on this machine: PostgreSQL, two stock vLLM servers with the CALM plugins, two gateway
replicas (upstream mode) behind HAProxy, HAProxy in front of the engines. The same questions go (1) to the engines
through their HAProxy frontend, as the exact completion requests the gateway sends (the same version's head named, the
same log-probs asked for), and (2) to the gateways through theirs, as chat requests, at concurrency 1, 8 and 32.
Multiple choice with raw confidence off (one engine request per question on both paths) and streamed free form.
As in bench_gateway.py, the served version has an identity letter-format head, so both paths score options the same
way. Every process shares the machine's cores: read the ratio, not the absolute numbers. Each run is charged the CPU
seconds of each part of the fleet (engines, gateway replicas, HAProxy, PostgreSQL; the load generator is this process),
so a ratio below 1 shows whose CPU the engines lost.
Results: fleet.json and fleet.md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adapters.clients.upstream import _payload  # noqa: E402  (the exact body the gateway sends upstream)
from benchmarks.engines.bench_engine_server import engine_usage  # noqa: E402  (a process tree's CPU, from /proc)
from benchmarks.gateway.bench_gateway import (  # noqa: E402
    CONCURRENCY, FREE_TOKENS, load, make_sender, ratio_rows, workloads,
)
from calm_core.engine import EngineRequest  # noqa: E402
from tests.fleet import MODEL, Fleet  # noqa: E402
from tests.postgres import postgres_server  # noqa: E402


def named(bodies: list[dict], version: str) -> list[dict]:
    """The direct bodies as the gateway sends them: naming the served version's head."""
    return [{**b, "vllm_xargs": {"calm_head": version}} for b in bodies]


ROLES = ("engines", "gateways", "haproxy", "postgres", "load")


def cpu_seconds(fleet: Fleet) -> dict[str, float]:
    """User + kernel CPU seconds so far of each part of the fleet (a process's tree; PostgreSQL's processes by name;
    this process alone, whose children are the fleet)."""
    def tree(name: str) -> float:
        usage = engine_usage(fleet.procs[name].pid)
        return usage["user_s"] + usage["system_s"]

    def alone(procs) -> float:
        total = 0.0
        for proc in procs:
            try:
                total += sum(proc.cpu_times()[:2])
            except psutil.NoSuchProcess:
                continue
        return total

    return {"engines": tree("engine0") + tree("engine1"), "gateways": tree("gateway0") + tree("gateway1"),
            "haproxy": tree("haproxy"),
            "postgres": alone(p for p in psutil.process_iter(["name"]) if p.info["name"] == "postgres"),
            "load": alone([psutil.Process()])}


def measured_level(fleet: Fleet, runs: dict[str, tuple[str, list[dict]]], concurrency: int) -> dict:
    """Each named run's bodies sent to its URL, one run after the other, each charged every role's CPU seconds."""
    row = {}
    for name, (url, bodies) in runs.items():
        before, start = cpu_seconds(fleet), time.perf_counter()
        row[name] = asyncio.run(load(make_sender(url), bodies, concurrency))
        after = cpu_seconds(fleet)
        row[name]["cpu_s"] = {role: after[role] - before[role] for role in ROLES}
        row[name]["wall_s"] = time.perf_counter() - start
    print(f"concurrency {concurrency}: " + ", ".join(
        f"{k} {v['rps']:.2f} rps p50 {v['p50_ms']:.0f} ms cpu " + "/".join(f"{v['cpu_s'][r]:.1f}" for r in ROLES)
        for k, v in row.items()), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--requests", type=int, default=48, help="requests per concurrency level and path")
    args = parser.parse_args()
    logs = args.out / "logs" / "fleet"
    logs.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from calm_core.artifact import load_artifact
    from calm_core.db import Database
    from calm_core.models import prepare_embedded, resolve_model
    from calm_core.registry import Registry
    from training.artifacts import write_identity_artifact

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).path)
    direct_mc, _, gw_mc_noraw, direct_ff, gw_ff = workloads(tokenizer, args.requests)
    identity = logs / "identity-artifact"
    if not identity.exists():
        write_identity_artifact(identity, None, with_reference=False)
    version = load_artifact(identity).manifest.artifact_version
    direct_mc, direct_ff = named(direct_mc, version), named(direct_ff, version)
    assert _payload(MODEL, version, EngineRequest("x", "p"))["vllm_xargs"] == {"calm_head": version}
    results: dict = {"requests_per_level": args.requests, "free_form_tokens": FREE_TOKENS, "cpus": os.cpu_count()}
    with postgres_server() as db_url:
        fleet = Fleet(logs, prepare_embedded("float32"), db_url)
        Registry(Database(db_url), fleet.registry).ensure_default(identity)
        fleet.gateway_env = {"CALM_ARTIFACT": str(identity)}
        with fleet.stack:
            fleet.start()
            direct_url = f"http://127.0.0.1:{fleet.engine_lb_port}/v1/completions"
            gw_url = f"{fleet.lb}/v1/chat/completions"
            # Warm-up: every prompt once on each engine, so the paths compared, which run one after the other, both
            # find its question in vLLM's prefix cache (with only 8 warmed, the fleet's 48 multiple-choice requests
            # at concurrency 32, asked after the direct ones, ran 1.88x as fast); then both replicas.
            prompts = direct_mc + [{**b, "max_tokens": 1} for b in direct_ff]
            for i in range(2):
                asyncio.run(load(make_sender(f"{fleet.engine_url(i)}/v1/completions"), prompts, 8))
            asyncio.run(load(make_sender(gw_url), gw_mc_noraw[:8], 8))
            for c in CONCURRENCY:
                results[f"c{c}"] = measured_level(fleet, {
                    "mc_direct": (direct_url, direct_mc), "mc_fleet": (gw_url, gw_mc_noraw),
                    "ff_direct": (direct_url, direct_ff), "ff_fleet": (gw_url, gw_ff)}, c)
    (args.out / "fleet.json").write_text(json.dumps(results, indent=2))
    (args.out / "fleet.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    lines = [
        f"Two gateway replicas behind HAProxy, in front of two stock vLLM engines with the CALM plugins (behind HAProxy), "
        f"against the same engines called directly through HAProxy with the requests the gateway sends; "
        f"{r['requests_per_level']} requests per level, {r['cpus']} CPUs shared by every process "
        f"(`python benchmarks/gateway/bench_fleet.py`). Free form: {r['free_form_tokens']} tokens, streamed.",
        "",
        "| workload | concurrency | direct rps | fleet rps | ratio | direct p50 ms | fleet p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    workloads = (("multiple choice, raw_confidence off", "mc_direct", "mc_fleet"), ("free form", "ff_direct", "ff_fleet"))
    lines += ratio_rows(r, workloads)
    lines += ["", "CPU per request (ms), by part, in the same runs (each path's requests charged what every process spent "
              "while they ran; the load generator is the benchmark's own process):", "",
              "| workload | concurrency | path | engines | gateways | HAProxy | PostgreSQL | load generator | total |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in CONCURRENCY:
        for name, *paths in workloads:
            for label, key in zip(("direct", "fleet"), paths):
                run = r[f"c{c}"][key]
                per = {role: 1000 * run["cpu_s"][role] / run["n"] for role in ROLES}
                lines.append(f"| {name} | {c} | {label} | " + " | ".join(f"{per[role]:.1f}" for role in ROLES)
                             + f" | {sum(per.values()):.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
