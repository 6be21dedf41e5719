"""Where the gateway's added latency in front of the real engine goes: the request it sends, changed one step at a
time from the direct call it is compared with, then the gateway itself, at concurrency 1, in one run.

    python benchmarks/gateway/bench_added_latency.py --out benchmarks/results [--rounds 3] [--questions 32]

`calm engine` (vLLM on CPU, the embedded model, identity artifact) alone on core 1; the gateway (upstream mode) and
this client on core 0, as bench_lean.py's engine part runs. Free-form chat questions (TriviaQA), 16 tokens, greedy.
Each variant sends every question in a row, after one unmeasured request (a block per variant and round, the order
of the blocks rotating per round): at concurrency 1 one request follows the last, so each path's connections stay
open, as a client's steady traffic keeps them. (Until 2026-12-05 the variants alternated question by question: each
gateway request then came ~7 answers after the last, past the 4 s after which the gateway closes an idle upstream
connection, so every one opened a new connection to the engine, which no direct variant did.) Per variant: p50
latency and the median over questions of its difference to the direct chat call,
and the CPU the engine's API server process spent per request (the HTTP side of vLLM, on the engine's core: what
formatting an answer costs, without the noise of 1 s answers). Each request's time inside the engine is vLLM's own
(the growth of `vllm:e2e_request_latency_seconds_sum`, from the request's arrival at the engine, tokenized, to its
last token; one request at a time, so the growth is that request's): the time outside it (the client's latency minus
that) is what the HTTP hops, the API server and the gateway add, without the decode steps' jitter, which at
concurrency 1 is larger than the few milliseconds being compared.

Variants, each one change from the one named in brackets:
  chat+logprobs        the direct baseline of lean.md: /v1/chat/completions, logprobs, top_logprobs 5, JSON
  completions-ids      /v1/completions with the chat template's token ids as prompt, logprobs 5, JSON (chat+logprobs)
  +token-ids-out       return_tokens_as_token_ids, what the gateway parses (completions-ids)
  +alpha-head          the α head named per request (vllm_xargs) (+token-ids-out)
  text-prompt          the prompt as the chat template's text, for vLLM to tokenize: exactly the gateway's payload for
                       a question answered whole (adapters/clients/upstream.py `_payload`) (+alpha-head)
  gateway              the same question through `calm serve` in upstream mode (text-prompt)
  +stream              the gateway's payload streamed (SSE, usage chunk), as it asks for a streamed free-form answer,
                       and as it asked for every answer before 2026-12-04 (text-prompt)
Results: added_latency.json and added_latency.md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from adapters.clients.upstream import _payload  # noqa: E402
from tests.memory_budget import start_and_cpu_s  # noqa: E402
from calm_cli.serving import engine_server_command  # noqa: E402
from calm_core.data import load_open  # noqa: E402
from calm_core.prompts import render_chat  # noqa: E402
from calm_core.engine import EngineRequest  # noqa: E402
from gateway.settings import GatewaySettings  # noqa: E402
from tests.servers import calm_argv, free_port, metric_values, running  # noqa: E402

MODEL = GatewaySettings.model_fields["served_model_name"].default
MAX_TOKENS = 16
TOP = 5
WARM_QUESTION = "Which planet is known as the Red Planet?"  # each block's unmeasured first request


def variants(tokenizer, question: str, head: str) -> dict[str, tuple[str, dict]]:
    """Each variant's (path, body) for one question."""
    messages = [{"role": "user", "content": question}]
    # The prompt's token ids as the gateway makes them: the rendered chat text, encoded without special tokens.
    # (apply_chat_template(tokenize=True) returns a BatchEncoding in this transformers: list() of it was its two key
    # names, which vLLM took as two 3-token prompts, so every completions variant here measured two 16-token answers to
    # nothing until 2026-12-04.)
    ids = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
    chat = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
            "top_logprobs": TOP}
    plain = {"model": MODEL, "prompt": list(ids), "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": TOP,
             "add_special_tokens": False}
    ids_out = {**plain, "return_tokens_as_token_ids": True}
    request = EngineRequest("bench", prompt="", prompt_token_ids=tuple(ids), max_tokens=MAX_TOKENS, temperature=0.0,
                            top_logprobs=TOP)
    with_head = _payload(MODEL, head, request, stream=False)
    # The gateway draws a free-form answer without the head (its confidence is read back through it afterwards).
    as_text = replace(request, prompt=render_chat(tokenizer, messages), prompt_token_ids=(), calibrated=False)
    text, streamed = (_payload(MODEL, head, as_text, stream=stream) for stream in (False, True))
    gateway = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return {"chat+logprobs": ("/v1/chat/completions", chat), "completions-ids": ("/v1/completions", plain),
            "+token-ids-out": ("/v1/completions", ids_out), "+alpha-head": ("/v1/completions", with_head),
            "text-prompt": ("/v1/completions", text),
            "gateway": ("/v1/chat/completions", gateway), "+stream": ("/v1/completions", streamed)}


# The variant each step is measured from (one change each).
STEP_FROM = {"completions-ids": "chat+logprobs", "+token-ids-out": "completions-ids", "+alpha-head": "+token-ids-out",
             "text-prompt": "+alpha-head", "gateway": "text-prompt", "+stream": "text-prompt"}


def timed(client: httpx.Client, url: str, body: dict) -> float:
    started = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        for _ in response.iter_bytes():
            pass
        if response.status_code != 200:
            raise SystemExit(f"{url} answered {response.status_code}")
    return (time.perf_counter() - started) * 1000


def engine_seconds(engine: str) -> float:
    """vLLM's summed end-to-end time of the requests it finished (its Prometheus histogram's sum)."""
    return sum(metric_values(engine, "vllm:e2e_request_latency_seconds_sum"))


def paired_median(a: dict[int, float], b: dict[int, float]) -> float:
    return statistics.median(a[i] - b[i] for i in b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--questions", type=int, default=32)
    args = parser.parse_args()
    logs = REPO / "benchmarks" / "results" / "logs" / "added-latency"
    logs.mkdir(parents=True, exist_ok=True)
    from training.artifacts import write_identity_artifact
    from training.scoring import load_tokenizer
    from calm_core.models import resolve_model

    identity = logs / "identity"
    if not identity.is_dir():
        write_identity_artifact(identity, with_reference=False)
    tokenizer = load_tokenizer(resolve_model(None, "float32").path)
    questions = [q.question for q in load_open("triviaqa")[: args.questions]]
    registry = logs / "registry"  # one folder: the gateway names its version per request, the engine looks it up there
    settings = GatewaySettings(artifact=str(identity), registry_dir=registry)
    port, gw = free_port(), free_port()
    argv, env, _ = engine_server_command(settings, "127.0.0.1", port)
    engine, gateway = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{gw}"
    os.sched_setaffinity(0, {0})
    samples: dict[str, dict[int, list[float]]] = {}
    inside: dict[str, dict[int, list[float]]] = {}  # ms inside the engine, per request
    api_cpu: dict[str, float] = {}  # the engine's API server's CPU seconds, summed per variant
    with ExitStack() as stack:
        server = stack.enter_context(running(["taskset", "-c", "1", *argv], f"{engine}/health", logs / "engine.log",
                                             env={**env, "VLLM_CPU_OMP_THREADS_BIND": "1"}, timeout=300))
        gw_env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": json.dumps([engine]), "CALM_ARTIFACT": str(identity),
                  "CALM_DB_PATH": str(logs / "gateway.sqlite3"), "CALM_REGISTRY_DIR": str(registry)}
        stack.enter_context(running(["taskset", "-c", "0", *calm_argv("serve", "--port", str(gw))], f"{gateway}/health",
                                    logs / "gateway.log", env=gw_env))
        head = httpx.get(f"{gateway}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["artifact_version"]
        client = stack.enter_context(httpx.Client(timeout=120))
        for q in questions[:4]:  # warm-up
            for name, (path, body) in variants(tokenizer, q, head).items():
                timed(client, (gateway if name == "gateway" else engine) + path, body)
        asked = [variants(tokenizer, q, head) for q in questions]
        warm = variants(tokenizer, WARM_QUESTION, head)
        names = list(warm)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                base = gateway if name == "gateway" else engine
                path, body = warm[name]
                timed(client, base + path, body)  # the block's connections opened, as steady traffic keeps them
                for i, named in enumerate(asked):
                    path, body = named[name]
                    # taskset execs the server: its pid is the API server's (its own CPU, not the engine core's)
                    engine_s = engine_seconds(engine)
                    cpu = start_and_cpu_s(server.pid)[1]
                    samples.setdefault(name, {}).setdefault(i, []).append(timed(client, base + path, body))
                    api_cpu[name] = api_cpu.get(name, 0.0) + start_and_cpu_s(server.pid)[1] - cpu
                    inside.setdefault(name, {}).setdefault(i, []).append(1000 * (engine_seconds(engine) - engine_s))
            print(f"round {r + 1} done", flush=True)
    os.sched_setaffinity(0, range(os.cpu_count()))
    per_q = {name: {i: statistics.median(xs) for i, xs in by_q.items()} for name, by_q in samples.items()}
    in_q = {name: {i: statistics.median(xs) for i, xs in by_q.items()} for name, by_q in inside.items()}
    out_q = {name: {i: statistics.median(t - e for t, e in zip(samples[name][i], inside[name][i])) for i in by_q}
             for name, by_q in samples.items()}
    direct = "chat+logprobs"
    results = {name: {"p50_ms": statistics.median(per_q[name].values()),
                      "vs_direct_ms": paired_median(per_q[name], per_q[direct]),
                      "step_from": STEP_FROM.get(name),
                      "api_server_cpu_ms": 1000 * api_cpu[name] / sum(map(len, samples[name].values())),
                      "step_ms": paired_median(per_q[name], per_q[STEP_FROM[name]]) if name in STEP_FROM else 0.0,
                      "inside_p50_ms": statistics.median(in_q[name].values()),
                      "inside_vs_direct_ms": paired_median(in_q[name], in_q[direct]),
                      "outside_p50_ms": statistics.median(out_q[name].values()),
                      "outside_vs_direct_ms": paired_median(out_q[name], out_q[direct]),
                      "outside_step_ms": (paired_median(out_q[name], out_q[STEP_FROM[name]])
                                          if name in STEP_FROM else 0.0)}
               for name in per_q}
    results["_run"] = {"questions": len(questions), "rounds": args.rounds, "max_tokens": MAX_TOKENS}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "added_latency.json").write_text(json.dumps(results, indent=2))
    (args.out / "added_latency.md").write_text(markdown(results))
    print(markdown(results))


def markdown(r: dict) -> str:
    run = r["_run"]
    lines = [f"`python benchmarks/gateway/bench_added_latency.py --questions {run['questions']} --rounds {run['rounds']}` "
             f"(one run, {run['questions']} TriviaQA questions x "
             f"{run['rounds']} rounds, {run['max_tokens']} tokens greedy, concurrency 1; `calm engine` alone on core 1, "
             "gateway and client on core 0):", "",
             "| request | p50 ms | vs direct chat + log-probs (median paired) | this step (median paired) | step from "
             "| engine's API server CPU per request (ms) | inside the engine: p50 ms, vs direct | outside the engine: "
             "p50 ms | outside: vs direct | outside: this step |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for name, x in r.items():
        if not name.startswith("_"):
            lines.append(f"| {name} | {x['p50_ms']:.1f} | {x['vs_direct_ms']:+.1f} ms | {x['step_ms']:+.1f} ms "
                         f"| {x['step_from'] or '-'} | {x['api_server_cpu_ms']:.1f} "
                         f"| {x['inside_p50_ms']:.1f}, {x['inside_vs_direct_ms']:+.1f} | {x['outside_p50_ms']:.2f} "
                         f"| {x['outside_vs_direct_ms']:+.2f} ms | {x['outside_step_ms']:+.2f} ms |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
