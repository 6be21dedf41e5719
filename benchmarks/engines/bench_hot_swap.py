"""What a promotion costs the traffic a gateway serves meanwhile. A real gateway on the embedded model (in-process
engines, the shipped artifact, a registry polled every second); one client asks MedMCQA questions one at a time in
the `medicine` domain (four options, one pass), another reads /metrics every 0.1 s as Prometheus would. Per round a
copy of the shipped artifact is registered as a new version and promoted for `science`: the gateway builds its merged
weights and starts its engines (adapter, one-pass folded weights, free-form mode) while the old version answers,
then switches science's route. The medicine requests never change version, so what they see is the swap's cost to
everyone else.

Per phase (5 s before the promotion; from the promotion until /health shows the new route; 5 s after) and pooled over
the rounds: each client's latency p50 / p99 / max, and how many /metrics reads took over 1 s (a scrape that would
time out at a 1 s interval, as the retraining-loop tests scrape). Per round: the swap's seconds and the machine's
memory in use (MemTotal - MemFree, page cache included) when it began and at its peak; and, before the gateway starts,
how much memory the machine gives at full speed (scripts/memory_ceiling.py: on the 2-core VMs memory the host no longer
backs is ~25x slower to touch, and a swap that needs it takes several times longer).

    python benchmarks/engines/bench_hot_swap.py [--rounds 2]   -> benchmarks/results/hot_swap.{json,md,png}
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from safetensors.torch import load_file, save_file  # noqa: E402

from adapters.hosting.merged_weights import served_weights_key  # noqa: E402
from calm_core.artifact import load_artifact, record_files, update_manifest  # noqa: E402
from calm_core.data import load_mc  # noqa: E402
from calm_core.db import Database  # noqa: E402
from calm_core.paths import BUNDLED_DIR, calm_home  # noqa: E402
from calm_core.registry import Registry  # noqa: E402
from scripts.memory_ceiling import in_use_gb, probe  # noqa: E402
from tests.servers import calm_argv, free_port, running  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
OUT = REPO / "benchmarks" / "results" / "hot_swap"
SHIPPED = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"
MODEL = "calm-smollm2-135m"
SETTLE_S = 5.0
PHASES = ("before", "during", "after")


class Client(threading.Thread):
    """Calls `call` back to back (sleeping `pause_s` between calls) and records (start, seconds, ok) until stopped."""

    def __init__(self, call, pause_s: float = 0.0):
        super().__init__(daemon=True)
        self.call, self.pause_s = call, pause_s
        self.samples: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                ok = self.call()
            except httpx.HTTPError:
                ok = False
            self.samples.append((started, time.monotonic() - started, ok))
            time.sleep(self.pause_s)

    def between(self, start: float, end: float) -> list[tuple[float, float, bool]]:
        return [s for s in self.samples if start <= s[0] < end]


def stats(samples: list[tuple[float, float, bool]]) -> dict:
    seconds = np.array([s[1] for s in samples])
    return {"n": len(samples), "failed": sum(not s[2] for s in samples),
            "p50_ms": float(np.percentile(seconds, 50) * 1000), "p99_ms": float(np.percentile(seconds, 99) * 1000),
            "max_ms": float(seconds.max() * 1000), "over_1s": int((seconds > 1.0).sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settle", type=float, default=SETTLE_S, help="seconds measured before and after each swap")
    args = parser.parse_args()
    questions = load_mc("medmcqa", root=SHARED_DATA)[:200]
    fast = probe(step_gb=1.0, slow=4.0)  # the machine as the swaps will find it
    print("memory at full speed before the gateway starts: "
          f"{'all' if fast.fast_until_gb is None else f'{fast.fast_until_gb:.1f} GB'} in use", flush=True)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        env = {"CALM_DB_PATH": str(tmp / "gw.sqlite3"), "CALM_REGISTRY_DIR": str(tmp / "registry"),
               "CALM_REGISTRY_POLL_S": "1", "OMP_NUM_THREADS": "1"}
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        with running(calm_argv("serve", "--port", str(port)), f"{base}/health/ready", tmp / "gw.log", env, timeout=600):
            http = httpx.Client(timeout=60)
            asked = itertools.count()

            def ask() -> bool:
                q = questions[next(asked) % len(questions)]
                r = http.post(f"{base}/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": q.question}], "options": list(q.choices),
                    "metadata": {"domain": "medicine"}})
                return r.status_code == 200

            scrape = httpx.Client(timeout=10)
            requests, metrics = Client(ask), Client(lambda: scrape.get(f"{base}/metrics").status_code == 200, 0.1)
            memory: list[tuple[float, float]] = []  # (time, GB in use)

            def sample_memory() -> bool:
                memory.append((time.monotonic(), in_use_gb()))
                return True

            memory_sampler = Client(sample_memory, 0.5)
            requests.start(), metrics.start(), memory_sampler.start()
            registry = Registry(Database(str(tmp / "gw.sqlite3")), tmp / "registry")  # the gateway's (settings.py)
            windows, swapped = [], []
            for i in range(args.rounds):
                source = tmp / f"v{i}"
                shutil.copytree(SHIPPED, source)
                version = f"bench-swap-{i}"
                # An adapter file of its own, as a retrained version has: served copies are named by what their
                # weights are made of, and a byte-identical adapter would be served by the shipped version's engines.
                adapter = source / "adapter" / "adapter_model.safetensors"
                save_file(load_file(str(adapter)), str(adapter), metadata={"format": "pt", "bench_round": str(i)})
                update_manifest(source, artifact_version=version, files=None)
                record_files(source)
                registry.add(source, trigger="operator", domain="science")
                swapped.append(load_artifact(source))
                time.sleep(args.settle)
                promoted = time.monotonic()
                registry.promote(version, "science", actor="bench")
                while http.get(f"{base}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["versions"]["routes"].get("science") != version:
                    time.sleep(0.2)
                switched = time.monotonic()
                print(f"round {i + 1}: science switched to {version} after {switched - promoted:.1f} s", flush=True)
                time.sleep(args.settle)
                windows.append({"before": (promoted - args.settle, promoted), "during": (promoted, switched),
                                "after": (switched, switched + args.settle), "swap_s": switched - promoted})
            for client in (requests, metrics, memory_sampler):
                client.stop.set()
                client.join()
            for w in windows:
                during = [gb for t, gb in memory if w["during"][0] <= t <= w["during"][1]]
                w["memory_gb"] = {"at_promotion": round(during[0], 1), "peak": round(max(during), 1)}
        # The gateway's own account of each swap (merging, engines started), kept beside the results.
        log = OUT.parent / "logs" / "hot_swap.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp / "gw.log", log)
    for version in swapped:  # each version's copies of the weights (~0.5 GB each) in CALM_HOME
        key = served_weights_key(version)
        for built in [calm_home() / "merged" / key, *(calm_home() / "folded").glob(f"{key}-*")]:
            shutil.rmtree(built, ignore_errors=True)

    def pooled(client: Client, phase: str) -> dict:
        return stats([s for w in windows for s in client.between(*w[phase])])

    summary = {"rounds": args.rounds, "swap_s": [round(w["swap_s"], 1) for w in windows],
               "memory_gb": [w["memory_gb"] for w in windows], "fast_memory_gb": fast.fast_until_gb,
               "phases": {p: {"request": pooled(requests, p), "metrics": pooled(metrics, p)} for p in PHASES},
               "date": time.strftime("%Y-%m-%d %H:%M")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    OUT.with_suffix(".md").write_text(markdown(summary))
    plot(requests, metrics, memory, windows, fast.fast_until_gb, OUT.with_suffix(".png"))
    print(markdown(summary))


def plot(requests: Client, metrics: Client, memory: list[tuple[float, float]], windows: list[dict],
         fast_gb: float | None, png: Path) -> None:
    """Latencies and memory in use over the run, the swaps shaded: where a swap's slowness comes from, at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = memory[0][0]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    for client, label, size in ((requests, "medicine request", 4), (metrics, "/metrics read", 2)):
        top.plot([s[0] - t0 for s in client.samples], [s[1] * 1000 for s in client.samples], ".", ms=size, label=label)
    top.set_yscale("log")
    top.set_ylabel("latency (ms)")
    bottom.plot([t - t0 for t, _ in memory], [gb for _, gb in memory], color="black", label="memory in use")
    if fast_gb is not None:
        bottom.axhline(fast_gb, ls="--", color="red", label="full speed up to (probed before the start)")
    bottom.set_ylabel("GB in use (page cache included)")
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        for i, w in enumerate(windows):
            ax.axvspan(w["during"][0] - t0, w["during"][1] - t0, color="orange", alpha=0.2,
                       label="swap (promotion to route switched)" if i == 0 and ax is bottom else None)
        ax.legend(loc="upper left", fontsize=8)
    top.set_title("A promotion for `science` while `medicine` is served (benchmarks/engines/bench_hot_swap.py)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def markdown(summary: dict) -> str:
    memory = "; ".join(f"{m['at_promotion']:.1f} -> {m['peak']:.1f}" for m in summary["memory_gb"])
    fast_memory = "all" if summary["fast_memory_gb"] is None else f"{summary['fast_memory_gb']:.1f}"
    lines = [f"A promotion for `science` while `medicine` is asked one question at a time ({summary['rounds']} rounds, "
             f"{summary['date']}; swaps took {', '.join(f'{s:.0f}' for s in summary['swap_s'])} s; the machine's "
             f"memory in use at each promotion -> its peak during the swap, GB: {memory}; memory came at full speed up "
             f"to {fast_memory} GB in use before the gateway started):", "",
             "| phase | requests | p50 (ms) | p99 (ms) | max (ms) | /metrics reads | p50 (ms) | p99 (ms) | max (ms) | "
             "over 1 s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for phase in PHASES:
        r, m = summary["phases"][phase]["request"], summary["phases"][phase]["metrics"]
        lines.append(f"| {phase} | {r['n']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['max_ms']:.0f} | {m['n']} | "
                     f"{m['p50_ms']:.1f} | {m['p99_ms']:.0f} | {m['max_ms']:.0f} | {m['over_1s']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
