"""What multiple choice costs through the shipped artifact, side by side in one run, gateway in-process (`calm serve`).

    python benchmarks/scoring/bench_cloze_serving.py --out benchmarks/results

Four gateways answer the same ARC-Easy questions (4 options, raw-model pass off) at concurrency 8:
  letter    an identity head scored by the answer letter: one engine request per question (the old default);
  cloze     the shipped α head without its LoRA adapter: one request per option token;
  shipped   the shipped artifact, in-process (the default): the same requests on a second engine with merged weights;
  upstream  the shipped artifact through `calm engine`, which serves the adapter with vLLM's LoRA path;
plus free-form answers on the shipped gateway (base weights, no adapter). Results: cloze_serving.json / .md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gateway.bench_gateway import load, make_sender  # noqa: E402
from calm_cli.serving import DEFAULT_ARTIFACTS  # noqa: E402
from calm_core.data import load_mc  # noqa: E402
from calm_core.models import EMBEDDED_ID  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

MODEL = "calm-smollm2-135m"
CONCURRENCY = 8


def artifacts(folder: Path) -> dict[str, Path]:
    from training.artifacts import write_identity_artifact

    shipped = DEFAULT_ARTIFACTS[EMBEDDED_ID]
    letter, cloze = folder / "letter", folder / "cloze-no-adapter"
    write_identity_artifact(letter, None, with_reference=False)
    shutil.rmtree(cloze, ignore_errors=True)
    shutil.copytree(shipped, cloze, ignore=shutil.ignore_patterns("adapter"))
    manifest = json.loads((cloze / "manifest.json").read_text())
    (cloze / "manifest.json").write_text(json.dumps({**manifest, "has_adapter": False}, indent=2))
    return {"letter": letter, "cloze": cloze, "shipped": shipped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--questions", type=int, default=32)
    args = parser.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    questions = [q for q in load_mc("arc_easy", "dev") if q.n_options == 4][: args.questions]
    mc = [{"model": MODEL, "messages": [{"role": "user", "content": q.question}], "options": list(q.choices),
           "calm": {"raw_confidence": False}} for q in questions]
    ff = [{"model": MODEL, "messages": [{"role": "user", "content": f"In one sentence: {q.question}"}], "max_tokens": 32,
           "temperature": 0} for q in questions[:16]]
    results: dict = {"questions": len(questions), "concurrency": CONCURRENCY}
    for name, artifact in artifacts(logs).items():
        port = free_port()
        env = {"CALM_DB_PATH": str(logs / f"cloze-{name}.sqlite3")}
        with running(calm_argv("serve", "--port", str(port), "--artifact", str(artifact)),
                     f"http://127.0.0.1:{port}/health", logs / f"cloze-{name}.log", env=env, timeout=300):
            send = make_sender(f"http://127.0.0.1:{port}/v1/chat/completions")
            asyncio.run(load(send, mc[:4], 4))  # warm-up
            results[name] = asyncio.run(load(send, mc, CONCURRENCY))
            if name == "shipped":
                results["shipped_free_form"] = asyncio.run(load(send, ff, CONCURRENCY))
        print(f"{name}: {results[name]['rps']:.2f} questions/s, p50 {results[name]['p50_ms']:.0f} ms", flush=True)
    e_port, g_port = free_port(), free_port()
    env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": json.dumps([f"http://127.0.0.1:{e_port}"]),
           "CALM_DB_PATH": str(logs / "cloze-upstream.sqlite3"), "CALM_UPSTREAM_TIMEOUT_S": "600"}
    with running(calm_argv("engine", "--port", str(e_port)), f"http://127.0.0.1:{e_port}/health",
                 logs / "cloze-engine.log", timeout=300), \
         running(calm_argv("serve", "--port", str(g_port)), f"http://127.0.0.1:{g_port}/health",
                 logs / "cloze-upstream.log", env=env):
        send = make_sender(f"http://127.0.0.1:{g_port}/v1/chat/completions")
        asyncio.run(load(send, mc[:4], 4))
        results["upstream"] = asyncio.run(load(send, mc, CONCURRENCY))
    print(f"upstream: {results['upstream']['rps']:.2f} questions/s", flush=True)
    base = results["letter"]["rps"]
    lines = ["| gateway | questions/s | p50 ms | p90 ms | throughput vs letter |", "|---|---|---|---|---|"]
    for name in ("letter", "cloze", "shipped", "upstream"):
        r = results[name]
        lines.append(f"| {name} | {r['rps']:.2f} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | {r['rps'] / base:.2f} |")
    ff_row = results["shipped_free_form"]
    lines.append(f"\nFree form on the shipped gateway (32 tokens, base weights): {ff_row['rps']:.2f} answers/s, "
                 f"p50 {ff_row['p50_ms']:.0f} ms.")
    (args.out / "cloze_serving.json").write_text(json.dumps(results, indent=2))
    (args.out / "cloze_serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
