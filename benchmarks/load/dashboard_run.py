"""The Grafana dashboard's panels over a recorded run, drawn with matplotlib (no Grafana server runs here).

`calm serve` (the shipped default) behind a real Prometheus (Debian's, scraping every 2 s); traffic in three phases
through the gateway's API, each waited out by count, not by clock:
1. in domain: ARC science questions in `science` (an abstain policy at 0.35) and MedMCQA questions in `medicine` (a
   guaranteed-risk policy fitted on 30 uploaded labels), each answer's verdict sent as feedback, a bad request now
   and then (a model the gateway does not serve: a 404);
2. shifted: trivia posed as 2-way choices arriving in `science` (the drift the alert is for);
3. in domain again for `medicine` only.
Then every query of every panel (gateway/observe/dashboard.py, `$domain` = all, `$__rate_interval` = 20 s) is read over the
run with Prometheus's range API into dashboard_run.json, and drawn panel by panel into dashboard.png; dashboard.md
lists the panels and what each showed (docs/deployment.md's copy).

    python benchmarks/load/dashboard_run.py [--out benchmarks/results]          # record and draw (about 5 minutes)
    python benchmarks/load/dashboard_run.py --draw-only                          # draw again from dashboard_run.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_core.data import load_mc, load_open  # noqa: E402
from gateway.observe.dashboard import PanelSpec, panels  # noqa: E402
from tests.servers import calm_argv, free_port, running, wait_until  # noqa: E402

SHARED_DATA = REPO.parent / "shared" / "data"
ADMIN = {"Authorization": "Bearer dev-admin-key"}
MODEL = "calm-smollm2-135m"
RATE_INTERVAL = "20s"
STEP_S = 2


def questions(shared: Path) -> dict[str, list[dict]]:
    """Each phase's questions as {question, choices, answer, domain}."""
    rng = random.Random(0)
    science = load_mc("arc_easy", "test", root=shared)[:100] + load_mc("arc_challenge", "test", root=shared)[:50]
    medicine = [q for q in load_mc("medmcqa", "dev", root=shared) if q.n_options == 4][:190]
    trivia = load_open("triviaqa", root=shared)
    pool = [t.answer for t in trivia[600:900]]
    shifted = []
    for t in trivia[:150]:
        options = [t.answer, rng.choice([a for a in pool if a != t.answer])]
        rng.shuffle(options)
        shifted.append({"question": t.question, "choices": options, "answer": options.index(t.answer),
                        "domain": "science"})

    def mc(qs, domain):
        return [{"question": q.question, "choices": list(q.choices), "answer": q.answer, "domain": domain} for q in qs]

    med = mc(medicine, "medicine")
    in_domain = mc(science, "science") + med[30:130]
    rng.shuffle(in_domain)
    return {"labels": med[:30], "in_domain": in_domain, "shifted": shifted, "medicine_again": med[130:]}


def ask(gateway: str, q: dict, bad_too: bool) -> None:
    """One question and the verdict on its answer; with `bad_too` also a request for a model not served (a 404)."""
    r = httpx.post(f"{gateway}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": q["question"]}], "options": q["choices"],
        "metadata": {"domain": q["domain"]}})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    if not choice["calibration"]["abstained"]:
        label = choice["calibration"]["options"]
        chosen = max(range(len(label)), key=lambda i: label[i]["probability"])
        httpx.post(f"{gateway}/v1/feedback", json={"response_id": r.json()["id"], "correct": chosen == q["answer"]},
                   timeout=60).raise_for_status()
    if bad_too:
        bad = httpx.post(f"{gateway}/v1/chat/completions", timeout=60, json={
            "model": "no-such-model", "messages": [{"role": "user", "content": q["question"]}],
            "metadata": {"domain": q["domain"]}})
        assert bad.status_code == 404, bad.text


def drive(gateway: str, phase: list[dict]) -> None:
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: ask(gateway, phase[i], i % 25 == 0), range(len(phase))))


def record(out: Path) -> dict:
    for tool in ("prometheus",):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: `apt-get install prometheus` (scripts/test.sh installs it)")
    phases = questions(SHARED_DATA)
    tmp = Path(tempfile.mkdtemp(prefix="calm-dashboard-"))
    gw_port, prom_port = free_port(), free_port()
    gateway, prometheus = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{prom_port}"
    (tmp / "prometheus.yml").write_text(f"""
global: {{scrape_interval: {STEP_S}s, evaluation_interval: {STEP_S}s}}
scrape_configs:
  - job_name: calm-gateway
    static_configs: [{{targets: ["127.0.0.1:{gw_port}"]}}]
""")
    prom_argv = [shutil.which("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"]
    env = {"CALM_DB_PATH": str(tmp / "gw.sqlite3"), "CALM_DRIFT_WINDOW": "60"}
    marks = {}
    with running(calm_argv("serve", "--port", str(gw_port)), f"{gateway}/health/ready", tmp / "gw.log", env), \
         running(prom_argv, f"{prometheus}/-/ready", tmp / "prom.log", timeout=60):
        print(f"gateway and Prometheus up; logs in {tmp}", flush=True)
        start = time.time()
        policies = {"science": {"threshold": 0.35, "action": "abstain", "message": "Not sure; ask a person."},
                    "medicine": {"target_risk": 0.9, "delta": 0.2, "min_labels": 30, "fallback": "label_free",
                                 "action": "annotate"}}
        for domain, policy in policies.items():
            httpx.put(f"{gateway}/admin/policies/{domain}", json=policy, headers=ADMIN).raise_for_status()
        labels = [{"question": q["question"], "options": q["choices"], "answer": q["answer"]} for q in phases["labels"]]
        httpx.post(f"{gateway}/admin/labels/medicine", json={"questions": labels}, headers=ADMIN,
                   timeout=600).raise_for_status()
        for name in ("in_domain", "shifted", "medicine_again"):
            print(f"[{time.time() - start:5.0f} s] phase {name}: {len(phases[name])} questions", flush=True)
            marks[name] = time.time()
            drive(gateway, phases[name])
        end = time.time()
        # The last answers' effect on rates needs two scrapes after them.
        wait_until("two scrapes after the traffic", lambda: _scraped_after(prometheus, end + STEP_S), 60, 0.5)
        end = time.time()
        recorded = {"start": start, "end": end, "step_s": STEP_S, "phases": marks,
                    "panels": [_panel(prometheus, spec, start, end) for spec in panels()]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "dashboard_run.json").write_text(json.dumps(recorded) + "\n")
    print(f"[{end - start:5.0f} s] recorded {len(recorded['panels'])} panels", flush=True)
    return recorded


def _scraped_after(prometheus: str, t: float) -> bool:
    result = httpx.get(f"{prometheus}/api/v1/query", params={"query": "timestamp(up)"}).json()["data"]["result"]
    return bool(result) and float(result[0]["value"][1]) > t


def _panel(prometheus: str, spec: PanelSpec, start: float, end: float) -> dict:
    series = []
    for q in spec.queries:
        expr = q.expr.replace("$domain", ".*").replace("$__rate_interval", RATE_INTERVAL)
        result = httpx.get(f"{prometheus}/api/v1/query_range", params={
            "query": expr, "start": start, "end": end, "step": STEP_S}).json()["data"]["result"]
        for s in result:
            legend = re.sub(r"\{\{(\w+)\}\}", lambda m: s["metric"].get(m.group(1), ""), q.legend)
            points = [(float(t) - start, float(v)) for t, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
            series.append({"legend": legend, "labels": s["metric"], "points": points})
    return {"row": spec.row, "title": spec.title, "unit": spec.unit, "threshold": spec.threshold, "series": series}


def draw(recorded: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = recorded["panels"]
    cols = 3
    rows = -(-len(specs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    phase_starts = sorted((t - recorded["start"], name) for name, t in recorded["phases"].items())
    for ax, panel in zip(axes.flat, specs):
        for s in panel["series"]:
            if s["points"]:
                t, v = zip(*s["points"])
                ax.plot(t, v, label=s["legend"][:40], lw=1.2)
        if panel["threshold"] is not None:
            ax.axhline(panel["threshold"], color="red", ls="--", lw=1, label=f"alert threshold {panel['threshold']}")
        for t, name in phase_starts:
            ax.axvline(t, color="grey", lw=0.6, ls=":")
        ax.set_title(f"{panel['row']}: {panel['title']}", fontsize=9)
        ax.set_xlabel("seconds into the run (dotted: phase starts)", fontsize=7)
        ax.set_ylabel(panel["unit"], fontsize=7)
        ax.tick_params(labelsize=7)
        if panel["series"]:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(specs):]:
        ax.axis("off")
    fig.suptitle("CALM Gateway dashboard over a recorded run (benchmarks/load/dashboard_run.py)", fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def summary(recorded: dict, png_name: str) -> str:
    phases = ", ".join(f"{name} at {t - recorded['start']:.0f} s" for name, t in
                       sorted(recorded["phases"].items(), key=lambda kv: kv[1]))
    lines = [f"![The dashboard's panels over a recorded run]({png_name})", "",
             f"A run of {recorded['end'] - recorded['start']:.0f} s (phases: {phases}); per panel, the series its "
             "queries returned and each series' last value:", "",
             "| row | panel | series | last values |", "|---|---|---:|---|"]
    for p in recorded["panels"]:
        last = "; ".join(f"{s['legend']} {s['points'][-1][1]:.3g}" for s in p["series"][:4] if s["points"])
        more = f" (+{len(p['series']) - 4} more)" if len(p["series"]) > 4 else ""
        lines.append(f"| {p['row']} | {p['title']} | {len(p['series'])} | {last}{more} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--draw-only", action="store_true", help="draw from the recorded dashboard_run.json")
    args = parser.parse_args()
    recorded = (json.loads((args.out / "dashboard_run.json").read_text()) if args.draw_only else record(args.out))
    draw(recorded, args.out / "dashboard.png")
    # The summary is copied into docs/deployment.md (scripts/readme_numbers.py): the image's path as read from docs/.
    docs_path = Path("..") / (args.out / "dashboard.png").resolve().relative_to(REPO)
    (args.out / "dashboard.md").write_text(summary(recorded, str(docs_path)) + "\n")
    print(f"wrote {args.out / 'dashboard.png'} and dashboard.md")


if __name__ == "__main__":
    main()
