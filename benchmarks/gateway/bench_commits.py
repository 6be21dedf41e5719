"""The gateway of two commits side by side: bench_lean.py's ceiling (one core, instant upstream, wrk) and the latency
it adds at concurrency 1, the two gateways interleaved in rounds, so a change to the request path is measured against
the code before it in one run on one machine.

    python benchmarks/gateway/bench_commits.py --old df27e4c~1 [--new HEAD] [--rounds 5] [--seconds 10]

Each commit is checked out into a git worktree under --out/logs and served from this checkout's virtual environment
(the worktree first on PYTHONPATH). Results: commits.json and commits.md in --out.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gateway.bench_lean import WRK_SCRIPT, chat_body, run_wrk  # noqa: E402
from tests.servers import free_port, running  # noqa: E402


def worktree(logs: Path, rev: str) -> tuple[Path, str]:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    path = logs / f"worktree-{sha}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL)
    return path, sha


def start_gateway(stack: ExitStack, tree: Path, upstream: str, logs: Path, tag: str, identity: Path) -> str:
    port = free_port()
    env = {"CALM_ENGINE": "upstream", "CALM_UPSTREAM_URLS": json.dumps([upstream]), "PYTHONPATH": str(tree),
           "CALM_DB_PATH": str(logs / f"gateway-{tag}.sqlite3"), "CALM_ARTIFACT": str(identity)}
    # -P: the working directory (this checkout) is not put before PYTHONPATH, so the commit's code is what runs.
    argv = ["taskset", "-c", "0", sys.executable, "-P", "-m", "calm_cli", "serve", "--port", str(port)]
    stack.enter_context(running(argv, f"http://127.0.0.1:{port}/health", logs / f"gateway-{tag}.log", env=env))
    return f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default="HEAD")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from training.artifacts import write_identity_artifact

    identity = logs / "identity-artifact"
    if not identity.exists():
        write_identity_artifact(identity, None, with_reference=False)
    trees = {"old": worktree(logs, args.old), "new": worktree(logs, args.new)}
    script = logs / "commits.lua"
    script.write_text(WRK_SCRIPT.format(body=json.dumps(chat_body("What is the capital of France?")),
                                        key=f"sk-{secrets.token_hex(8)}"))
    runs = {t: {"rps": [], "c1_p50_ms": []} for t in trees}
    direct = []
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        stack.enter_context(running(["taskset", "-c", "1", sys.executable,
                                     str(REPO / "benchmarks" / "gateway" / "instant_upstream.py"), str(port)],
                                    f"{upstream}/health", logs / "instant-commits.log"))
        urls = {t: start_gateway(stack, tree, upstream, logs, f"commit-{sha}", identity) for t, (tree, sha) in trees.items()}
        for url in urls.values():
            run_wrk(url, script, 3, args.connections)  # warm-up
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(reversed(urls))
            for t in order:
                runs[t]["rps"].append(run_wrk(urls[t], script, args.seconds, args.connections)["rps"])
            for t in order:
                runs[t]["c1_p50_ms"].append(run_wrk(urls[t], script, max(args.seconds // 2, 3), 1)["p50_ms"])
            direct.append(run_wrk(upstream, script, max(args.seconds // 2, 3), 1)["p50_ms"])
            print(f"round {r + 1}: " + ", ".join(f"{t} {runs[t]['rps'][-1]:.0f} rps" for t in order), flush=True)
    base = statistics.median(direct)
    result = {"setup": vars(args) | {"out": str(args.out)}, "direct_c1_p50_ms": base,
              "commits": {t: {"commit": trees[t][1], "rps": statistics.median(v["rps"]),
                              "c1_added_ms": statistics.median(v["c1_p50_ms"]) - base, "runs": v}
                          for t, v in runs.items()}}
    (args.out / "commits.json").write_text(json.dumps(result, indent=2))
    old, new = result["commits"]["old"], result["commits"]["new"]
    lines = ["# The gateway of two commits side by side (`python benchmarks/gateway/bench_commits.py`)", "",
             f"Instant upstream, each gateway on one core, wrk with {args.connections} connections, {args.rounds} "
             f"interleaved rounds of {args.seconds} s (medians).", "",
             "| commit | ceiling (requests/s) | added p50 at concurrency 1 (ms) |", "|---|---|---|",
             f"| {old['commit']} (old) | {old['rps']:.0f} | {old['c1_added_ms']:.2f} |",
             f"| {new['commit']} (new) | {new['rps']:.0f} | {new['c1_added_ms']:.2f} |", "",
             f"Ceiling ratio new / old: {new['rps'] / old['rps']:.3f}; added latency new - old: "
             f"{new['c1_added_ms'] - old['c1_added_ms']:+.2f} ms."]
    (args.out / "commits.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
