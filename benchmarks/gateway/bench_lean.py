"""The gateway's request path against LiteLLM's proxy and a minimal pass-through, in front of the same engine, in one
run with the proxies interleaved.

    python benchmarks/gateway/bench_lean.py --out benchmarks/results [--profile] [--parts engine_shared engine_own_core ceiling]

1. Real engine (`calm engine`: vLLM with the α head, the embedded model), free-form chat completions, greedy, at
   concurrency 1, 8 and 32: the same questions sent directly and through each proxy, one batch per target, in
   rounds whose order rotates, so slow drift of the machine hits all alike: throughput relative to calling the engine
   directly, and the added latency as the median over questions of (through the proxy - direct), same question.
   Twice: with engine, proxies and clients sharing both cores (a CPU engine's OpenMP threads then delay every other
   process), and with the engine alone on core 1 and the rest on core 0 (as a GPU engine leaves the host's cores to
   the proxy).
2. Ceiling: each proxy pinned to one core (taskset) in front of an instant stand-in upstream
   (benchmarks/gateway/instant_upstream.py), driven by wrk (C; it and the stand-in share the other core), rounds interleaved:
   requests per second and median latency. `--profile` also records the gateway there with py-spy
   (logs/gateway-profile.txt: collapsed stacks of the thread holding the GIL; lean.md sums them by stage).

LiteLLM (`litellm[proxy]==1.108.7`, LITELLM_LOCAL_MODEL_COST_MAP=True) runs from its own virtual environment
(benchmarks/.venv-litellm, made on first use: its pins differ from vLLM's). wrk comes from Debian (installed on first
use when running as root). Results: lean.json and lean.md in --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_cli.serving import engine_server_command  # noqa: E402
from calm_core.data import load_open  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402
from scripts.machine_probe import this_cpu  # noqa: E402
from tests.litellm_proxy import LITELLM, litellm_proxy  # noqa: E402

MODEL = GatewaySettings.model_fields["served_model_name"].default
CONCURRENCY = (1, 8, 32)
MAX_TOKENS = 16
PROXIES = ("gateway", "litellm", "passthrough")


def wrk_binary() -> str:
    if shutil.which("wrk") is None:
        if os.geteuid() != 0:
            raise SystemExit("wrk is needed (Debian: apt-get install wrk)")
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=True, stdout=subprocess.DEVNULL)
    return "wrk"


def upstream_gateway_env(upstream: str, logs: Path, tag: str, identity: Path) -> dict[str, str]:
    """A gateway in front of `upstream` serving the identity artifact, its database and registry under `logs`. One
    registry folder with the engine: the gateway names its version per request, the engine looks it up there."""
    return {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": json.dumps([upstream]),
            "CALM_DB_PATH": str(logs / f"gateway-{tag}.sqlite3"), "CALM_ARTIFACT": str(identity),
            "CALM_REGISTRY_DIR": str(logs / "registry")}


class Proxies:
    """The three proxies in front of one upstream, each started on demand (optionally pinned to a core)."""

    def __init__(self, stack: ExitStack, upstream: str, logs: Path, key: str, identity: Path, core: int | None):
        self.stack, self.upstream, self.logs, self.key, self.core = stack, upstream, logs, key, core
        self.identity = identity

    def _pin(self, argv: list[str]) -> list[str]:
        return ["taskset", "-c", str(self.core), *argv] if self.core is not None else argv

    def start(self, tag: str) -> dict[str, str]:
        gw, pt = free_port(), free_port()
        env = upstream_gateway_env(self.upstream, self.logs, tag, self.identity)
        self.stack.enter_context(running(self._pin(calm_argv("serve", "--port", str(gw))),
                                         f"http://127.0.0.1:{gw}/health", self.logs / f"gateway-{tag}.log", env=env))
        litellm = self.stack.enter_context(litellm_proxy(MODEL, f"{self.upstream}/v1", self.logs / f"litellm-{tag}",
                                                         prefix=self._pin([]), key=self.key))
        self.stack.enter_context(running(
            self._pin([sys.executable, str(REPO / "benchmarks" / "gateway" / "passthrough.py"), str(pt), self.upstream]),
            f"http://127.0.0.1:{pt}/health", self.logs / f"passthrough-{tag}.log"))
        return {"gateway": f"http://127.0.0.1:{gw}", "litellm": litellm,
                "passthrough": f"http://127.0.0.1:{pt}"}


def chat_body(question: str, logprobs: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    # What the gateway asks of the engine for a confidence: the answer's log-probs, 5 alternatives (for entropy).
    return {**body, "logprobs": True, "top_logprobs": 5} if logprobs else body


# The baseline each proxy is compared with: the engine doing the same work. The gateway's confidence needs the
# answer's log-probs, which the engine computes at a cost of its own (the proxies forward plain requests).
BASELINE = {"gateway": "direct+logprobs", "litellm": "direct", "passthrough": "direct"}


async def batch(url: str, key: str, questions: list[str], concurrency: int,
                logprobs: bool = False) -> tuple[dict[int, float], float]:
    """Every question through one target by `concurrency` workers: latency per question, and the wall time."""
    latency: dict[int, float] = {}
    work = list(enumerate(questions))
    headers = {"Authorization": f"Bearer {key}"}

    async def worker(session: aiohttp.ClientSession):
        while work:
            i, q = work.pop()
            start = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=chat_body(q, logprobs), headers=headers) as r:
                body = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url} answered {r.status}: {body[:300]!r}")
            latency[i] = time.perf_counter() - start

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return latency, time.perf_counter() - start


def level(targets: dict[str, str], key: str, questions: list[str], concurrency: int, rounds: int) -> dict:
    """Rounds of one batch per target, the order rotating each round: throughput over all rounds, and per question
    the median latency, so a proxy's added latency is paired with the direct call of the same question."""
    names = list(targets)
    latency = {t: {i: [] for i in range(len(questions))} for t in names}
    wall = {t: 0.0 for t in names}
    for r in range(rounds):
        for t in names[r % len(names):] + names[: r % len(names)]:
            lat, seconds = asyncio.run(batch(targets[t], key, questions, concurrency, t == "direct+logprobs"))
            wall[t] += seconds
            for i, x in lat.items():
                latency[t][i].append(x)
    per_q = {t: {i: statistics.median(xs) for i, xs in latency[t].items()} for t in names}
    out = {t: {"n": rounds * len(questions), "rps": rounds * len(questions) / wall[t],
               "p50_ms": 1000 * statistics.median(per_q[t].values())} for t in names}
    for t, base in BASELINE.items():
        for name, of in (("", base), ("_vs_direct", "direct")):
            out[t]["ratio" + name] = out[t]["rps"] / out[of]["rps"]
            out[t]["added_p50_ms" + name] = 1000 * statistics.median(per_q[t][i] - per_q[of][i] for i in per_q[t])
    return out


def engine_part(logs: Path, identity: Path, key: str, questions: list[str], per_level: dict[int, int],
                rounds: int, own_core: bool) -> dict:
    """`own_core`: the engine pinned to core 1 (its OpenMP threads bound there), proxies and clients to core 0, as a
    GPU engine leaves the host's cores to the proxy; otherwise everything shares every core."""
    settings = GatewaySettings(artifact=str(identity), registry_dir=logs / "registry")
    port = free_port()
    argv, env, _ = engine_server_command(settings, "127.0.0.1", port)
    if own_core:
        argv, env = ["taskset", "-c", "1", *argv], {**env, "VLLM_CPU_OMP_THREADS_BIND": "1"}
        os.sched_setaffinity(0, {0})
    upstream = f"http://127.0.0.1:{port}"
    results = {}
    with ExitStack() as stack:
        stack.enter_context(running(argv, f"{upstream}/health", logs / "engine.log", env=env, timeout=300))
        proxies = Proxies(stack, upstream, logs, key, identity, 0 if own_core else None)
        targets = {"direct": upstream, "direct+logprobs": upstream, **proxies.start("own-core" if own_core else "shared")}
        # Every question once into the engine's prefix cache first: otherwise the level's first batch (direct, in the
        # first round) alone met a cold cache (direct 5.8 against 7.3 requests/s with log-probs at concurrency 32).
        asyncio.run(batch(upstream, key, questions[: max(per_level.values())], 8))
        for url in targets.values():
            asyncio.run(batch(url, key, questions[:8], 4))  # warm-up of each path
        for c in CONCURRENCY:
            # One untimed batch of each kind of request at this concurrency first: a level's first batch ran slower
            # than the ones after it (at 32, the first batch with log-probs 6.14 requests/s, the rest 7.05-7.57; in
            # the level, plain direct calls, first in its first round, 5.80 and 6.14 against 7.3-7.5 with log-probs).
            for logprobs in (False, True):
                asyncio.run(batch(upstream, key, questions[: per_level[c]], c, logprobs))
            row = results[f"c{c}"] = level(targets, key, questions[: per_level[c]], c, rounds)
            print(f"engine, concurrency {c}: " + ", ".join(
                f"{t} {row[t]['rps']:.2f} rps" + (f" (x{row[t]['ratio']:.3f}, {row[t]['added_p50_ms']:+.1f} ms)"
                                                  if t in BASELINE else "") for t in row), flush=True)
    os.sched_setaffinity(0, range(os.cpu_count()))
    return results


WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
"""
# Each request a different question in turn: what caches keyed by the request (the gateway's chat template renders)
# cannot serve.
WRK_DISTINCT = """bodies = {{ {bodies} }}
i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", nil, {{["Content-Type"] = "application/json", ["Authorization"] = "Bearer {key}"}}, bodies[i])
end
"""
DISTINCT = ("gateway", "passthrough")


def lua_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def run_wrk(url: str, script: Path, seconds: int, connections: int, path: str = "/v1/chat/completions") -> dict:
    out = subprocess.run(["taskset", "-c", "1", wrk_binary(), "-t1", f"-c{connections}", f"-d{seconds}s", "--latency",
                          "-s", str(script), f"{url}{path}"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)\b", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[p50.group(2)]
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "p50_ms": float(p50.group(1)) * scale, "non_2xx": int(bad.group(1)) if bad else 0,
            "socket_errors": errors.group(1) if errors else None}


def ceiling_part(logs: Path, identity: Path, key: str, rounds: int, seconds: int, connections: int,
                 profile: Path | None, questions: list[str]) -> dict:
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    script, distinct = logs / "ceiling.lua", logs / "ceiling-distinct.lua"
    script.write_text(WRK_SCRIPT.format(body=json.dumps(chat_body("What is the capital of France?")), key=key))
    distinct.write_text(WRK_DISTINCT.format(bodies=", ".join(lua_string(json.dumps(chat_body(q))) for q in questions),
                                            key=key))
    runs: dict[str, list[dict]] = {t: [] for t in PROXIES}
    distinct_runs: dict[str, list[dict]] = {t: [] for t in DISTINCT}
    alone: dict[str, list[float]] = {t: [] for t in ("direct", *PROXIES)}  # p50 at concurrency 1
    with ExitStack() as stack:
        stack.enter_context(running(["taskset", "-c", "1", sys.executable,
                                     str(REPO / "benchmarks" / "gateway" / "instant_upstream.py"), str(port)],
                                    f"{upstream}/health", logs / "instant.log"))
        urls = Proxies(stack, upstream, logs, key, identity, 0).start("ceiling")
        for t in PROXIES:
            run_wrk(urls[t], script, 3, connections)  # warm-up
        for r in range(rounds):
            for t in PROXIES[r % len(PROXIES):] + PROXIES[: r % len(PROXIES)]:
                runs[t].append(run_wrk(urls[t], script, seconds, connections))
                print(f"ceiling round {r + 1}: {t} {runs[t][-1]['rps']:.0f} rps", flush=True)
            for t in DISTINCT:
                distinct_runs[t].append(run_wrk(urls[t], distinct, seconds, connections))
                print(f"ceiling round {r + 1}: {t}, distinct questions {distinct_runs[t][-1]['rps']:.0f} rps", flush=True)
            # One request at a time: the latency a proxy adds by itself (no engine time, no queueing).
            for t, url in {"direct": upstream, **urls}.items():
                alone[t].append(run_wrk(url, script, max(seconds // 2, 3), 1)["p50_ms"])
        if profile is not None:
            gateway_pid = _listening_pid(urls["gateway"])
            spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "-p", str(gateway_pid),
                                    "-d", str(seconds), "-r", "500", "--gil", "--nonblocking", "-f", "raw", "-o",
                                    str(profile)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            run_wrk(urls["gateway"], script, seconds + 2, connections)
            spy.wait()
    out = {t: {"rps": statistics.median(x["rps"] for x in rs), "p50_ms": statistics.median(x["p50_ms"] for x in rs),
               "runs": rs} for t, rs in runs.items()}
    for t, rs in distinct_runs.items():
        out[t]["distinct_rps"] = statistics.median(x["rps"] for x in rs)
        out[t]["distinct_runs"] = rs
    out["distinct_questions"] = len(questions)
    direct = statistics.median(alone["direct"])
    for t in PROXIES:
        out[t]["c1_p50_ms"] = statistics.median(alone[t])
        out[t]["c1_added_ms"] = out[t]["c1_p50_ms"] - direct
    out["direct_c1_p50_ms"] = direct
    return out


# Stages of a request: a sample counts for the stage of its innermost frame that belongs to one.
STAGES = (
    ("response records (group commit, SQLite)", ("GroupCommit", "record_responses", "sqlalchemy/", "sqlite3")),
    ("upstream call (aiohttp client, answer parsing)", ("aiohttp/", "_stream_from", "_deltas", "_payload", "_sse_data",
                                                         "_decode", "_failover", "generate_whole")),
    ("chat template", ("prepare_chat", "render_chat", "_rendered", "jinja2/")),
    ("request checks (limits, sampling parameters)", ("engine_request",)),
    ("confidence, policy, metrics, drift", ("free_answers", "_calibration", "DomainMonitor", "prometheus_client/",
                                            "calm_core/scoring", "policies.py")),
    ("the rest of the gateway's own code", ("gateway/", "adapters/")),
    ("request parsing, validation, responses (FastAPI, pydantic)", ("fastapi/", "pydantic", "starlette/")),
    ("HTTP server (uvicorn, httptools)", ("uvicorn/", "httptools")),
)
OTHER = "event loop and the rest"


def _stage(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, marks in STAGES:
            if any(m in frame for m in marks):
                return name
    return OTHER


def profile_summary(collapsed: Path) -> list[tuple[str, float]]:
    """Share of the GIL-holding samples per stage of a request, from py-spy's collapsed stacks."""
    counts = {name: 0 for name, _ in STAGES} | {OTHER: 0}
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        counts[_stage(stack.split(";"))] += int(n)
    total = sum(counts.values())
    return [(name, n / total) for name, n in counts.items()]


def _listening_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"pid=(\d+)", out).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=3, help="ceiling: interleaved rounds per proxy")
    parser.add_argument("--seconds", type=int, default=10, help="ceiling: seconds per wrk run")
    parser.add_argument("--connections", type=int, default=32, help="ceiling: concurrent connections")
    parser.add_argument("--questions", type=int, default=96, help="engine part: questions at concurrency 32")
    parser.add_argument("--engine-rounds", type=int, default=2, help="engine part: interleaved rounds per level")
    parser.add_argument("--profile", action="store_true", help="record the gateway at its ceiling with py-spy")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["engine_own_core", "ceiling"],
                        help="what to measure now; the others are kept from the last run's lean.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    from training.artifacts import write_identity_artifact

    identity = logs / "identity-artifact"
    if not identity.exists():
        write_identity_artifact(identity, None, with_reference=False)
    key = f"sk-bench-{secrets.token_hex(16)}"  # LiteLLM's master key; the others ignore it
    questions = [q.question for q in load_open("triviaqa")][: args.questions]
    per_level = {1: max(args.questions // 6, 8), 8: max(args.questions // 2, 16), 32: args.questions}
    previous = json.loads((args.out / "lean.json").read_text()) if (args.out / "lean.json").exists() else {}
    results: dict = {**previous, "cpus": os.cpu_count(), "max_tokens": MAX_TOKENS, "litellm": LITELLM}
    results.setdefault("measured_at", {})
    results.setdefault("machine", {})  # the parts kept from an earlier run may have run on another kind of machine
    for part in args.parts:
        if part == "ceiling":
            results[part] = ceiling_part(logs, identity, key, args.rounds, args.seconds, args.connections,
                                         logs / "gateway-profile.txt" if args.profile else None,
                                         [q.question for q in load_open("triviaqa")][:1000])
            results["ceiling_setup"] = {"seconds": args.seconds, "rounds": args.rounds, "connections": args.connections}
            if args.profile:
                results["profile"] = profile_summary(logs / "gateway-profile.txt")
        else:
            results[part] = engine_part(logs, identity, key, questions, per_level, args.engine_rounds,
                                        own_core=part == "engine_own_core")
        results["measured_at"][part] = time.strftime("%Y-%m-%d %H:%M")
        results["machine"][part] = this_cpu()
    (args.out / "lean.json").write_text(json.dumps(results, indent=2))
    (args.out / "lean.md").write_text(markdown(results))
    print(markdown(results))


PARTS = ("engine_shared", "engine_own_core", "ceiling")
ENGINE_SETUPS = {"engine_shared": "engine, proxies and clients sharing both cores",
                 "engine_own_core": "the engine on core 1 alone, proxies and clients on core 0"}


def _when(r: dict, part: str) -> str:
    """When a part was measured, and on which CPU where recorded (runs before 2026-12-05 did not record it)."""
    machine = r.get("machine", {}).get(part)
    return r["measured_at"].get(part, "") + (f", {machine}" if machine else "")


def markdown(r: dict) -> str:
    lines = [f"Free-form chat completions ({r['max_tokens']} tokens, greedy); {r['cpus']} CPUs; LiteLLM `{r['litellm']}`.", ""]
    for part, setup in ENGINE_SETUPS.items():
        if part not in r:
            continue
        lines += [f"In front of the real engine (`calm engine`, vLLM on CPU, the embedded model), {setup} "
                  f"({_when(r, part)}). Ratio and added p50 against the engine doing the same work: "
                  "the gateway against direct calls asking for the log-probs its confidence needs, the others against "
                  "plain direct calls; in brackets, the gateway against plain direct calls:", "",
                  "| concurrency | direct rps | direct + log-probs rps | "
                  + " | ".join(f"{t} rps (ratio)" for t in PROXIES) + " | "
                  + " | ".join(f"{t} added p50 ms" for t in PROXIES) + " |",
                  "|---|---|---|" + "---|" * (2 * len(PROXIES))]
        for c in CONCURRENCY:
            row = r[part][f"c{c}"]
            gw = row["gateway"]
            lines.append(f"| {c} | {row['direct']['rps']:.2f} | {row['direct+logprobs']['rps']:.2f} | "
                         + " | ".join(f"{row[t]['rps']:.2f} ({row[t]['ratio']:.3f})" for t in PROXIES) + " | "
                         + f"{gw['added_p50_ms']:+.1f} ({gw['added_p50_ms_vs_direct']:+.1f}) | "
                         + " | ".join(f"{row[t]['added_p50_ms']:+.1f}" for t in PROXIES[1:]) + " |")
        lines.append("")
    if "ceiling" not in r:
        return "\n".join(lines) + "\n"
    s = r["ceiling_setup"]
    c = r["ceiling"]
    lines += [f"Ceiling: each proxy pinned to one core, instant upstream, wrk with {s['connections']} connections, "
              f"{s['rounds']} interleaved rounds of {s['seconds']} s (median; {_when(r, 'ceiling')}); the same question "
              "in every request "
              f"(the issue's measure), and {c.get('distinct_questions', 0)} distinct TriviaQA questions in turn (no "
              "cache keyed by the request helps):", "",
              "| proxy | requests/s | ratio to pass-through | p50 ms | runs (requests/s) | distinct questions: requests/s "
              "(ratio) | added p50 ms at concurrency 1 |", "|---|---|---|---|---|---|---|"]
    for t in PROXIES:
        runs = ", ".join(f"{x['rps']:.0f}" for x in c[t]["runs"])
        ratio = c[t]["rps"] / c["passthrough"]["rps"]
        distinct = (f"{c[t]['distinct_rps']:.0f} ({c[t]['distinct_rps'] / c['passthrough']['distinct_rps']:.3f})"
                    if "distinct_rps" in c[t] else "-")
        lines.append(f"| {t} | {c[t]['rps']:.0f} | {ratio:.3f} | {c[t]['p50_ms']:.1f} | {runs} | {distinct} | "
                     f"{c[t].get('c1_added_ms', float('nan')):+.2f} |")
    if r.get("profile"):
        lines += ["", "Where the gateway's CPU goes at its ceiling (py-spy, samples of the thread holding the GIL):", "",
                  "| stage | share |", "|---|---|"]
        lines += [f"| {stage} | {100 * share:.1f} % |" for stage, share in r["profile"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
