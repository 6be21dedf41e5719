"""Two versions of the gateway side by side at the ceiling (bench_lean.py's measure), to tell what one change is worth
when single runs of the ceiling vary by more than the change.

    python benchmarks/gateway/bench_ceiling_ab.py [--a REF] [--b REF] [--b-patch FILE] [--rounds N] [--out DIR]

A and B are checked out as git worktrees (A: `--a`, default HEAD; B: `--b`, default this working tree as it is, or a
ref; `--b-patch` is applied to B, e.g. benchmarks/patches/no-record.patch to take a stage out) and started from
there, each pinned to core 0 in front of the instant upstream on core 1, with the pass-through beside them. wrk rounds
go A, B, pass-through in a rotating order, so drift of the machine hits all three alike; the result is the median of
B/A per round, and each against the pass-through. Results: ab.json in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from benchmarks.gateway.bench_lean import (  # noqa: E402
    WRK_SCRIPT, _listening_pid, chat_body, run_wrk, upstream_gateway_env, wrk_binary,
)
from tests.servers import free_port, running  # noqa: E402


def worktree(stack: ExitStack, ref: str | None, patch: Path | None, root: Path, tag: str) -> Path:
    """A checkout of `ref` (None: the working tree itself, unless a patch must be applied to a copy of HEAD)."""
    if ref is None and patch is None:
        return REPO
    path = root / tag
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), ref or "HEAD"], check=True)
    stack.callback(subprocess.run, ["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)
    if ref is None:  # the working tree's uncommitted changes too
        diff = subprocess.run(["git", "-C", str(REPO), "diff", "HEAD"], capture_output=True, check=True).stdout
        if diff:
            subprocess.run(["git", "-C", str(path), "apply"], input=diff, check=True)
    if patch is not None:
        subprocess.run(["git", "-C", str(path), "apply", str(patch.resolve())], check=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="HEAD", help="git ref of A")
    parser.add_argument("--b", default=None, help="git ref of B (default: the working tree)")
    parser.add_argument("--b-patch", type=Path, default=None, help="a patch applied to B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "calm-ceiling-ab")
    args = parser.parse_args()
    wrk_binary()
    args.out.mkdir(parents=True, exist_ok=True)
    from training.artifacts import write_identity_artifact

    identity = args.out / "identity-artifact"
    if not identity.exists():
        write_identity_artifact(identity, None, with_reference=False)
    script = args.out / "ceiling.lua"
    script.write_text(WRK_SCRIPT.format(body=json.dumps(chat_body("What is the capital of France?")), key="sk-bench"))
    with ExitStack() as stack:
        trees = tempfile.mkdtemp(prefix="calm-ab-")
        stack.callback(shutil.rmtree, trees, ignore_errors=True)  # runs after the worktrees' removal (LIFO)
        sources = {"A": worktree(stack, args.a, None, Path(trees), "a"),
                   "B": worktree(stack, args.b, args.b_patch, Path(trees), "b")}
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        stack.enter_context(running(["taskset", "-c", "1", sys.executable,
                                     str(REPO / "benchmarks" / "gateway" / "instant_upstream.py"), str(port)],
                                    f"{upstream}/health", args.out / "instant.log"))
        urls = {}
        for tag, source in sources.items():
            gw = free_port()
            env = upstream_gateway_env(upstream, args.out, tag, identity)
            # From its own checkout: `python -m` puts the working directory first on the import path.
            stack.enter_context(running(["taskset", "-c", "0", sys.executable, "-m", "calm_cli", "serve", "--port",
                                         str(gw)], f"http://127.0.0.1:{gw}/health", args.out / f"gateway-{tag}.log",
                                        env=env, cwd=source))
            urls[tag] = f"http://127.0.0.1:{gw}"
        pt = free_port()
        stack.enter_context(running(["taskset", "-c", "0", sys.executable,
                                     str(REPO / "benchmarks" / "gateway" / "passthrough.py"), str(pt), upstream],
                                    f"http://127.0.0.1:{pt}/health", args.out / "passthrough.log"))
        urls["passthrough"] = f"http://127.0.0.1:{pt}"
        for url in urls.values():
            run_wrk(url, script, 3, args.connections)  # warm-up
        rps: dict[str, list[float]] = {t: [] for t in urls}
        # Each server's CPU time over its own wrk runs, per second: whether it was busy on its core the whole time.
        procs = {t: psutil.Process(_listening_pid(u)) for t, u in urls.items()}
        cpu: dict[str, list[float]] = {t: [] for t in urls}
        tags = list(urls)
        for r in range(args.rounds):
            for t in tags[r % 3:] + tags[:r % 3]:
                before, began = sum(procs[t].cpu_times()[:2]), time.monotonic()
                rps[t].append(run_wrk(urls[t], script, args.seconds, args.connections)["rps"])
                cpu[t].append((sum(procs[t].cpu_times()[:2]) - before) / (time.monotonic() - began))
            print(f"round {r + 1}: " + ", ".join(f"{t} {v[-1]:.0f}" for t, v in rps.items()) +
                  f"; B/A {rps['B'][-1] / rps['A'][-1]:.3f}", flush=True)
    result = {"a": args.a, "b": args.b or "working tree", "b_patch": str(args.b_patch) if args.b_patch else None,
              "rounds": args.rounds, "seconds": args.seconds, "connections": args.connections, "rps": rps,
              "cpu_share": {t: statistics.median(v) for t, v in cpu.items()},
              "b_over_a": statistics.median(b / a for a, b in zip(rps["A"], rps["B"])),
              "a_over_passthrough": statistics.median(a / p for a, p in zip(rps["A"], rps["passthrough"])),
              "b_over_passthrough": statistics.median(b / p for b, p in zip(rps["B"], rps["passthrough"]))}
    (args.out / "ab.json").write_text(json.dumps(result, indent=2))
    print(f"B/A {result['b_over_a']:.3f} (median of rounds); A/pass-through {result['a_over_passthrough']:.3f}, "
          f"B/pass-through {result['b_over_passthrough']:.3f}; CPU of a core while measured: " +
          ", ".join(f"{t} {v:.0%}" for t, v in result["cpu_share"].items()))


if __name__ == "__main__":
    main()
