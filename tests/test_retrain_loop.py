"""The retraining loop end to end, every part real: the gateway on the real vLLM engine and the shipped artifact, a real
Prometheus evaluating the shipped alert rules, a real Alertmanager routing with the shipped configuration to the
gateway's webhook, and `calm worker` training CALM on the embedded model.

Shifted traffic (trivia posed as 2-way choices in the science domain) makes the drift alert fire; Alertmanager calls
the gateway; the worker trains a smoke-sized candidate on the captured prompts, the gate passes it, it is promoted;
later answers in that domain carry the new version and the domain's drift gauge falls back under the threshold (the
candidate brought a reference histogram of the domain's own traffic). Then a candidate that fails its gate is not
promoted and the promoted version keeps serving. A second test kills the worker mid-job.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest

from calm_core.data import load_mc, load_open
from tests.loop_stack import (
    ADMIN, drift_alerts, http, jobs, loop_stack, prometheus_value, psi, registry_syncs, rules_evaluated_after,
)
from tests.recorded import record_runs, write_markdown
from tests.servers import REPO, background, calm_argv, free_port, wait_until

# memory_gb: the peak PSS of the gateway, the worker and its judging: 11.5 and 12.0 GB in the fresh clones of 1f4e691 (tests/memory_budget.py).
pytestmark = [pytest.mark.slow, pytest.mark.memory_gb(12.0)]


def two_way(shared_data, start: int, stop: int, seed: int) -> list[dict]:
    """Trivia questions as 2-way multiple choice (the gold answer and one other question's), options shuffled."""
    trivia = load_open("triviaqa", root=shared_data)
    pool = [t.answer for t in trivia[600:900]]
    rng = random.Random(seed)
    out = []
    for t in trivia[start:stop]:
        options = [t.answer, rng.choice([a for a in pool if a != t.answer])]
        rng.shuffle(options)
        out.append({"id": t.id, "dataset": "trivia2", "split": "test", "question": t.question, "choices": options,
                    "answer": options.index(t.answer), "domain": "science"})
    return out


@pytest.fixture(scope="module")
def loop(tmp_path_factory, embedded_model_dir, shared_data):
    tmp = tmp_path_factory.mktemp("loop")
    gw_port = free_port()
    # Labelled held-out questions of the domain's new traffic: the gate's in-domain test set, and the measurement of
    # ECE before and after (never trained on).
    test_file = tmp / "science-labelled.jsonl"
    test_file.write_text("".join(json.dumps(q) + "\n" for q in two_way(shared_data, 400, 500, seed=1)))
    # min_prompts: all 120 shifted questions. The alert fires on the first ones; the job waits for the rest
    # (capture_wait_s), so what it trains on does not depend on when the alert came.
    (tmp / "loop.toml").write_text(f"""
train_config = "configs/train/loop-smoke.toml"
runs_dir = "{tmp / 'jobs'}"
min_prompts = 120
accuracy_tolerance = 0.05
auto_promote_label_free = true
[[test_sets.science]]
dataset = "trivia2"
split = "test"
path = "{test_file}"
""")
    # A deliberately bad job: two CALM steps on θ and α (not the loop's θ held) at a θ learning rate 500 times the
    # smoke config's scramble the top layers, so the candidate ranks its answers little better than chance. Its
    # accuracy is not what stops it (any accuracy passes this config), its AUROC on the labelled test questions is:
    # the gate rejects it with that reason.
    bad_train = tmp / "bad-train.toml"
    bad_train.write_text((REPO / "configs/train/loop-smoke.toml").read_text().replace("steps = 8", "steps = 2")
                         .replace('method = "calm_head"', 'method = "calm_scalar"').replace("lr_theta = 2e-4", "lr_theta = 0.1"))
    assert 'method = "calm_scalar"' in bad_train.read_text() and "lr_theta = 0.1" in bad_train.read_text()
    # Judged on 200 labelled questions, the first 100 the loop's: a candidate ranking at chance has AUROC 0.5 with a
    # standard error of ~0.06 on 100 of them (about half right), so about one run in 30 it passed for as good as the shipped
    # version's 0.635 less the 0.02 tolerance (a fresh clone of 6da31cf: 0.640 at accuracy 0.44); on 200, ~0.04.
    bad_tests = tmp / "science-labelled-200.jsonl"
    bad_tests.write_text("".join(json.dumps(q) + "\n" for q in two_way(shared_data, 400, 600, seed=1)))
    (tmp / "bad.toml").write_text((tmp / "loop.toml").read_text().replace("accuracy_tolerance = 0.05",
                                  "accuracy_tolerance = 1.0\nmax_prompts = 40").replace(
                                  "min_prompts = 120", "min_prompts = 40").replace(
                                  "configs/train/loop-smoke.toml", str(bad_train)).replace(str(test_file), str(bad_tests)))
    assert str(bad_tests) in (tmp / "bad.toml").read_text()
    # A 100-answer drift window against a reference of 120 captured prompts: PSI's sampling noise stays near 0.06 for
    # traffic like the reference's (0.2 with 60 and 50, measured offline), well under the rule's 0.25. Every question
    # here is multiple choice (the jobs' judging runs in the worker, on engines of its own): the gateway starts no
    # engine for free form (the free-form mode shared by every version: 1.65 GB and 9 CPU s of start-up).
    env = {"CALM_DB_PATH": str(tmp / "gw.sqlite3"), "CALM_DRIFT_WINDOW": "100", "CALM_RAW_CONFIDENCE": "false",
           "CALM_REGISTRY_POLL_S": "1", "CALM_ANSWERS": "multiple_choice"}

    with loop_stack(tmp, gw_port, tmp / "loop.toml", env) as stack:
        yield stack


def ask(gateway: str, q: dict) -> dict:
    r = http.post(f"{gateway}/v1/chat/completions", timeout=300, json={
        "model": "calm-smollm2-135m", "messages": [{"role": "user", "content": q["question"]}],
        "options": q["choices"], "metadata": {"domain": "science"}})
    r.raise_for_status()
    return r.json()["choices"][0]["calibration"]


def send(gateway: str, questions: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda q: ask(gateway, q), questions))


# ~4 min on a quiet 2-core machine; 754 s alone on one 3.3x slower, where the suite's 15-minute hang limit killed it
# beside the other worker's tests (c8c2be4): the limit only turns a hang into a failure.
@pytest.mark.timeout(1800)
def test_drift_alert_retrains_on_captured_traffic_gates_promotes_and_the_domain_serves_the_new_version(loop, shared_data):
    gateway, tmp, prometheus = loop["gateway"], loop["tmp"], loop["prometheus"]
    health = http.get(f"{gateway}/health", headers=ADMIN).json()
    before_version = health["versions"]["routes"]["*"]
    # CALM_ANSWERS=multiple_choice: the shipped version without its free-form mode's engine (3 otherwise: adapter,
    # folded, free_form), and a free-form question refused in OpenAI's error shape.
    assert health["engine"]["engines"] == ["adapter", "folded"], health["engine"]
    assert "starting 2 vLLM engines (adapter, folded)" in (tmp / "gw.log").read_text()
    refused = http.post(f"{gateway}/v1/chat/completions", timeout=60, json={
        "model": "calm-smollm2-135m", "max_tokens": 1, "messages": [{"role": "user", "content": "Say yes."}]})
    assert refused.status_code == 400, refused.text
    assert {k: refused.json()["error"][k] for k in ("type", "param", "code")} == {
        "type": "invalid_request_error", "param": "options", "code": "free_form_not_served"}, refused.text

    # In-domain first: held-out grade-school science questions, from the population the shipped version's reference
    # histogram was built on. The alert stays quiet.
    science = load_mc("arc_easy", "test", root=shared_data)[:30] + load_mc("arc_challenge", "test", root=shared_data)[:20]
    send(gateway, [{"question": q.question, "choices": list(q.choices)} for q in science])
    # The window is full only after the last answer and nothing changes it afterwards, so an evaluation of the rule on
    # a scrape of the full window decides: no alert, not even pending, means none can fire later.
    scraped = wait_until("Prometheus to scrape the full in-domain window", lambda: prometheus_value(
        prometheus, 'timestamp(calm_drift_window_size{domain="science"} >= 50)'), 120, 0.2)
    wait_until("a rule evaluation after that scrape", lambda: rules_evaluated_after(prometheus, scraped), 120, 0.2)
    psi_in = psi(gateway)
    assert psi_in < 0.25, psi_in
    assert drift_alerts(prometheus, "science") == []

    r = http.put(f"{gateway}/admin/capture/science", json={"enabled": True}, headers=ADMIN)
    assert r.status_code == 200, r.text

    shifted = two_way(shared_data, 0, 120, seed=0)
    served = send(gateway, shifted)
    assert {c["artifact_version"] for c in served} == {before_version}
    psi_shifted = psi(gateway)
    assert psi_shifted > 0.25, psi_shifted

    job = wait_until("the drift alert to queue a job", lambda: (jobs(gateway, domain="science") or [None])[0], 240)
    assert job["trigger"] == "alert" and job["detail"]["alertname"] == "CalmConfidenceDrift"
    fired = drift_alerts(prometheus, "science")
    assert fired and fired[0]["state"] == "firing"
    assert fired[0]["labels"]["version"] == before_version  # the version whose window it measured (the webhook reads it)
    assert drift_alerts(prometheus, "medicine") == []  # domains without shifted traffic stay quiet

    done = wait_until("the job to finish", lambda: next(
        (j for j in jobs(gateway, domain="science") if j["status"] not in ("queued", "running")), None), 1200, 2)
    assert done["status"] == "promoted", json.dumps(done, indent=1)
    # The gate read every number it decided on, the label-free ones on the captured traffic included.
    reasons = " ".join(done["result"]["gate"]["reasons"])
    assert "AUROC" in reasons and "chosen option kept on" in reasons and "confidence ranking correlation" in reasons
    candidate = done["candidate"]
    routes = wait_until("the gateway to serve the candidate", lambda: (
        (h := http.get(f"{gateway}/health", headers=ADMIN).json()["versions"]["routes"]).get("science") == candidate and h), 400, 2)
    assert routes["*"] == before_version  # other domains keep the default
    promoted_at = time.time()

    after = send(gateway, two_way(shared_data, 120, 220, seed=2))
    assert {c["artifact_version"] for c in after} == {candidate}
    assert http.post(f"{gateway}/v1/chat/completions", timeout=60, json={
        "model": "calm-smollm2-135m", "messages": [{"role": "user", "content": "Which gas do plants take in?"}],
        "options": ["oxygen", "carbon dioxide"], "metadata": {"domain": "medicine"}}).json()["choices"][0][
        "calibration"]["artifact_version"] == before_version
    psi_after = psi(gateway)
    assert psi_after < 0.25, (psi_shifted, psi_after)

    record = http.get(f"{gateway}/admin/artifacts/{candidate}", headers=ADMIN).json()
    assert record["parent"] == before_version and record["trigger"] == "alert" and record["job_id"] == done["id"]
    assert record["status"] == "active" and record["active_for"] == ["science"] and record["calibration_sha256"]
    measured = {"psi_in_domain": round(psi_in, 3), "alert_to_promotion_s": round(done["finished_at"] - done["created_at"], 1),
                "promotion_to_serving_s": round(promoted_at - done["finished_at"], 1),
                "psi_shifted": round(psi_shifted, 3), "psi_after": round(psi_after, 3),
                "in_domain": done["result"]["in_domain"]}
    print("retraining loop:", json.dumps(measured), file=sys.stderr)
    record_loop_run(measured)

    # A candidate that ranks its answers worse is rejected with that reason, and the promoted version keeps serving.
    loop["worker"].send_signal(signal.SIGTERM)
    loop["worker"].wait(60)
    r = http.post(f"{gateway}/admin/jobs", json={"domain": "science"}, headers=ADMIN)
    assert r.status_code == 201 and r.json()["created"], r.text
    out = subprocess.run(calm_argv("worker", "--config", str(tmp / "bad.toml"), "--once"), cwd=REPO,
                         env={**os.environ, **loop["env"]}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rejected = http.get(f"{gateway}/admin/jobs/{r.json()['id']}", headers=ADMIN).json()
    assert rejected["status"] == "rejected", json.dumps(rejected, indent=1)
    bad = rejected["result"]["in_domain"]
    assert bad["candidate"]["auroc"] < bad["active"]["auroc"] - 0.02, bad
    record = http.get(f"{gateway}/admin/artifacts/{rejected['candidate']}", headers=ADMIN).json()
    assert record["status"] == "rejected" and "on the test questions" in record["reason"], record["reason"]
    assert f"AUROC {bad['candidate']['auroc']:.3f} below the active version's {bad['active']['auroc']:.3f}" in \
        record["reason"]
    # Two registry syncs after the rejection (the second one began after it was recorded): nothing switches.
    syncs = registry_syncs(gateway)
    wait_until("two registry syncs after the rejection", lambda: registry_syncs(gateway) >= syncs + 2, 120, 0.2)
    assert http.get(f"{gateway}/health", headers=ADMIN).json()["versions"]["routes"]["science"] == candidate
    assert {c["artifact_version"] for c in send(gateway, shifted[:4])} == {candidate}


MEDICINE_TRAFFIC, MEDICINE_HELD_OUT = slice(700, 760), slice(760, 910)


@pytest.mark.timeout(1200)
def test_a_label_free_job_on_a_domain_the_version_never_trained_on_lowers_ece_and_keeps_auroc(loop, shared_data):
    """Medical-exam questions (MedMCQA, four options; not in the training split) in the `medicine` domain, where the
    shipped version is more confident than it is right (offline, on 300 of them: accuracy 0.243 at confidence 0.316).
    Their confidence looks like science's (PSI 0.03 against its reference), so no drift alert fires: the operator
    queues the job. The shipped label-free job (CALM with θ held: the head alone, configs/train/loop-smoke.toml at CI
    size) keeps the serving version's answers and their ranking on the captured prompts and lowers its confidence;
    promoted, it is better calibrated on 150 held-out labelled questions of the domain and ranks right above wrong as
    well as the parent (AUROC within 0.02)."""
    gateway, tmp = loop["gateway"], loop["tmp"]
    if loop["worker"].poll() is None:  # the loop's own worker (another config) must not take this job
        loop["worker"].send_signal(signal.SIGTERM)
        loop["worker"].wait(60)
    questions = load_mc("medmcqa", "dev", root=shared_data)
    held_out = tmp / "medicine-labelled.jsonl"
    held_out.write_text("".join(json.dumps({"id": q.id, "dataset": "medmcqa", "split": "dev", "question": q.question,
                                            "choices": list(q.choices), "answer": q.answer, "domain": "medicine"}) + "\n"
                                for q in questions[MEDICINE_HELD_OUT]))
    (tmp / "medicine.toml").write_text((tmp / "loop.toml").read_text().replace("min_prompts = 120", "min_prompts = 60")
                                       .replace("[[test_sets.science]]", "[[test_sets.medicine]]")
                                       .replace(str(tmp / "science-labelled.jsonl"), str(held_out)))
    assert http.put(f"{gateway}/admin/capture/medicine", json={"enabled": True}, headers=ADMIN).status_code == 200
    for q in questions[MEDICINE_TRAFFIC]:  # one at a time: the captured order, hence the training batches, is fixed
        r = http.post(f"{gateway}/v1/chat/completions", timeout=300, json={
            "model": "calm-smollm2-135m", "messages": [{"role": "user", "content": q.question}],
            "options": list(q.choices), "metadata": {"domain": "medicine"}})
        assert r.status_code == 200, r.text
    r = http.post(f"{gateway}/admin/jobs", json={"domain": "medicine"}, headers=ADMIN)
    assert r.status_code == 201, r.text
    out = subprocess.run(calm_argv("worker", "--config", str(tmp / "medicine.toml"), "--once"), cwd=REPO,
                         env={**os.environ, **loop["env"]}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    done = http.get(f"{gateway}/admin/jobs/{r.json()['id']}", headers=ADMIN).json()
    assert done["status"] == "promoted", json.dumps(done, indent=1)
    judged, inputs = done["result"]["in_domain"], done["result"]["inputs"]
    print("label-free job on medicine:", json.dumps({"in_domain": judged, "inputs": inputs}), file=sys.stderr)
    assert judged["active"]["mean_confidence"] > judged["active"]["accuracy"], judged  # over-confident before
    assert judged["candidate"]["ece_10"] < judged["active"]["ece_10"], judged
    assert judged["candidate"]["auroc"] >= judged["active"]["auroc"] - 0.02, judged
    assert judged["candidate"]["accuracy"] >= judged["active"]["accuracy"] - 0.02, judged
    assert inputs["choice_agreement"] >= 0.95 and inputs["confidence_correlation"] >= 0.9, inputs
    record = http.get(f"{gateway}/admin/artifacts/{done['candidate']}", headers=ADMIN).json()
    assert done["candidate"].startswith("calm_head-") and record["active_for"] == ["medicine"], record


def record_loop_run(measured: dict) -> None:
    """The documented numbers of the loop (docs/retraining-loop.md): the newest two runs (training differs between runs: the captured prompts
    arrive in a different order)."""
    runs = record_runs("retrain_loop", {**measured, "date": datetime.now().strftime("%Y-%m-%d %H:%M")}, keep=2)
    write_markdown("retrain_loop", loop_runs_table(runs))


def loop_runs_table(runs: list[dict]) -> str:
    lines = ["| run | PSI in domain | PSI shifted | webhook → promoted (s) | promoted → served (s) | PSI after |",
             "|---|---:|---:|---:|---:|---:|"]
    for i, run in enumerate(runs, 1):
        lines.append(f"| {i} ({run['date']}) | {run['psi_in_domain']:.3f} | {run['psi_shifted']:.2f} | "
                     f"{run['alert_to_promotion_s']:.0f} | {run['promotion_to_serving_s']:.0f} | {run['psi_after']:.3f} |")
    lines += ["", f"On {runs[-1]['in_domain']['active']['n']:.0f} labelled held-out questions of the shifted traffic:", "",
              "| version | accuracy | mean confidence | ECE-10 | AUROC | Brier |", "|---|---|---|---|---|---|"]
    rows = [("shipped (active before)", runs[-1]["in_domain"]["active"])]
    rows += [(f"retrained for `science`, run {i}", run["in_domain"]["candidate"]) for i, run in enumerate(runs, 1)]
    for name, m in rows:
        lines.append(f"| {name} | {m['accuracy']:.3f} | {m['mean_confidence']:.3f} | {m['ece_10']:.3f} | "
                     f"{m['auroc']:.3f} | {m['brier']:.3f} |")
    return "\n".join(lines)


def test_a_worker_killed_mid_job_loses_no_job_and_leaves_no_half_written_artifact(tmp_path, embedded_model_dir, shared_data):
    from calm_core.capture import Capture, CaptureSettings
    from calm_core.db import Database
    from calm_core.jobs import JobQueue
    from calm_core.paths import BUNDLED_DIR
    from calm_core.registry import Registry

    db_path, registry_dir = tmp_path / "gw.sqlite3", tmp_path / "registry"
    db = Database(db_path)
    registry = Registry(db, registry_dir)
    default = registry.ensure_default(BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct")
    capture = Capture(db)
    on = capture.configure("science", CaptureSettings(enabled=True))
    capture.add("science", on, [("multiple_choice", q["question"], q["choices"], None) for q in two_way(shared_data, 0, 60, 0)])
    job, _ = JobQueue(db).enqueue("science", "operator")
    # Long enough to be killed mid-training: killed once 5 steps are logged (the last checkpoint at step 4, one every
    # 2), 10 steps in all, so that the resumed run's 6 new steps tell it apart from a run started over (10).
    steps = 10
    train = tmp_path / "train.toml"
    train.write_text((REPO / "configs/train/loop-smoke.toml").read_text().replace("steps = 8", f"steps = {steps}"))
    (tmp_path / "loop.toml").write_text(f'train_config = "{train}"\nruns_dir = "{tmp_path / "jobs"}"\n'
                                        "min_prompts = 40\naccuracy_tolerance = 1.0\nauto_promote_label_free = true\n")
    env = {"CALM_DB_PATH": str(db_path), "CALM_REGISTRY_DIR": str(registry_dir)}
    argv = calm_argv("worker", "--config", str(tmp_path / "loop.toml"), "--lease-s", "4")
    train_log = tmp_path / "jobs" / job.id / "run" / "train_log.jsonl"
    with background(argv, tmp_path / "worker1.log", env) as first:
        wait_until("training to pass its first checkpoints", lambda: train_log.is_file() and
                   len(train_log.read_text().splitlines()) >= 5, 300, 0.2)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed = JobQueue(db).get(job.id)
    assert killed.status == "running" and killed.candidate is None
    assert [r.version for r in registry.list()] == [default]  # nothing of the job's is in the registry
    steps_before = len(train_log.read_text().splitlines())

    with background(argv, tmp_path / "worker2.log", env):
        finished = wait_until("the resumed job to finish", lambda: (j := JobQueue(db).get(job.id)).status not in
                              ("queued", "running") and j, 600, 1)
    assert finished.status == "promoted", finished.log
    assert finished.attempts == 2 and any("resumed" in line for line in finished.log)
    assert any("resumed from the checkpoint at step" in line for line in finished.log), finished.log
    # Judged from the states the resumed training encoded: its 60 captured prompts and the smoke split's 16 tests.
    assert any("from the states training encoded below layer 26 (76 questions)" in line for line in finished.log), \
        finished.log
    logged = [json.loads(line)["step"] for line in train_log.read_text().splitlines()]
    assert logged[-1] == steps and len(logged) < steps_before + steps  # it went on from the checkpoint, not from step 0
    versions = [r.version for r in registry.list()]
    assert len(versions) == 2 and finished.candidate in versions  # exactly one candidate, complete and loadable
    from calm_core.artifact import load_artifact

    assert load_artifact(registry.path_of(finished.candidate)).manifest.reference_histograms["science"]
    visible = sorted(p.name for p in registry_dir.iterdir() if not p.name.startswith("."))
    assert visible == sorted(versions)
