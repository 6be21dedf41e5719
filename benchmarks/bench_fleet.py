"""Throughput of the fleet against its engines called directly, side by side in one run.

    python benchmarks/bench_fleet.py --out benchmarks/results

The fleet of tests/test_fleet.py on this machine: PostgreSQL, two stock vLLM servers with the CALM plugins, two gateway
replicas (upstream mode) behind HAProxy, HAProxy in front of the engines. The same questions go (1) to the engines
through their HAProxy frontend, as the exact completion requests the gateway sends (the same version's head named, the
same log-probs asked for), and (2) to the gateways through theirs, as chat requests, at concurrency 1, 8 and 32.
Multiple choice with raw confidence off (one engine request per question on both paths) and streamed free form.
As in bench_gateway.py, the served version has an identity letter-format head, so both paths score options the same
way. Every process shares the machine's cores: read the ratio, not the absolute numbers.
Results: fleet.json and fleet.md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from adapters.upstream import _payload  # noqa: E402  (the exact body the gateway sends upstream)
from benchmarks.bench_gateway import (  # noqa: E402
    CONCURRENCY, FREE_TOKENS, level, load, make_sender, ratio_rows, workloads,
)
from calm_core.engine import EngineRequest  # noqa: E402
from tests.fleet import MODEL, Fleet  # noqa: E402
from tests.postgres import postgres_server  # noqa: E402


def named(bodies: list[dict], version: str) -> list[dict]:
    """The direct bodies as the gateway sends them: naming the served version's head."""
    return [{**b, "vllm_xargs": {"calm_head": version}} for b in bodies]


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
            asyncio.run(load(make_sender(direct_url), direct_mc[:8], 8))  # warm-up: both engines, both replicas
            asyncio.run(load(make_sender(gw_url), gw_mc_noraw[:8], 8))
            for c in CONCURRENCY:
                results[f"c{c}"] = level({"mc_direct": (direct_url, direct_mc), "mc_fleet": (gw_url, gw_mc_noraw),
                                          "ff_direct": (direct_url, direct_ff), "ff_fleet": (gw_url, gw_ff)}, c)
    (args.out / "fleet.json").write_text(json.dumps(results, indent=2))
    (args.out / "fleet.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    lines = [
        f"Two gateway replicas behind HAProxy, in front of two stock vLLM engines with the CALM plugins (behind HAProxy), "
        f"against the same engines called directly through HAProxy with the requests the gateway sends; "
        f"{r['requests_per_level']} requests per level, {r['cpus']} CPUs shared by every process "
        f"(`python benchmarks/bench_fleet.py`). Free form: {r['free_form_tokens']} tokens, streamed.",
        "",
        "| workload | concurrency | direct rps | fleet rps | ratio | direct p50 ms | fleet p50 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += ratio_rows(r, (("multiple choice, raw_confidence off", "mc_direct", "mc_fleet"),
                            ("free form", "ff_direct", "ff_fleet")))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
