"""The retraining loop's state on both backends (SQLite and a real PostgreSQL): the artifact registry, the job queue
and traffic capture; and the promotion gate, a pure function."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from calm_core.artifact import load_artifact, update_manifest
from calm_core.capture import Capture, CaptureSettings
from calm_core.db import Database
from calm_core.errors import ArtifactError, ConfigError
from calm_core.jobs import JobQueue
from calm_core.paths import BUNDLED_DIR
from calm_core.registry import GLOBAL, Registry, RegistryError
from training.retrain.data import captured_questions
from training.retrain.gate import GateInputs, LoopConfig, gate
from tests.servers import wait_until

SHIPPED = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"


def artifact_copy(tmp_path, version: str):
    """The shipped artifact under another version id (same head and adapter): a distinct registry entry."""
    out = tmp_path / version
    shutil.copytree(SHIPPED, out)
    update_manifest(out, artifact_version=version)
    return out


def test_registry_versions_are_immutable_and_promotion_rollback_keep_one_active_per_domain(database, tmp_path):
    db = Database(database)
    registry = Registry(db, tmp_path / "registry")
    default = registry.ensure_default(SHIPPED)
    assert registry.active() == {GLOBAL: default} and registry.get(default).status == "active"
    assert registry.ensure_default(SHIPPED) == default  # idempotent across restarts

    source = artifact_copy(tmp_path, "cand-1")
    record = registry.add(source, trigger="alert", domain="science", parent=default, job_id="j1",
                          calibration_sha256="ab" * 32, metrics={"gate": "x"})
    assert record.status == "candidate" and record.parent == default and record.trigger == "alert"
    assert registry.add(source, trigger="alert").created_at == record.created_at  # registering again: the same row
    shutil.rmtree(source)  # the registry holds its own copy
    assert load_artifact(registry.path_of("cand-1")).manifest.artifact_version == "cand-1"

    assert registry.promote("cand-1", "science", "test") is None
    assert registry.serving("science") == "cand-1" and registry.serving("medicine") == default
    assert registry.get("cand-1").active_for == ("science",)
    registry.add(artifact_copy(tmp_path, "cand-2"), trigger="operator", domain="science")
    assert registry.promote("cand-2", "science", "test") == "cand-1"
    assert registry.get("cand-1").status == "retired" and registry.get("cand-2").status == "active"

    assert registry.rollback("science", "test") == "cand-1"  # back to the version before
    assert registry.serving("science") == "cand-1" and registry.get("cand-2").status == "retired"
    assert registry.rollback("science", "test") is None  # the domain's first version: back to the default
    assert registry.serving("science") == default
    with pytest.raises(RegistryError, match="no version of its own"):
        registry.rollback("science")
    with pytest.raises(RegistryError, match="no earlier version"):
        registry.rollback(GLOBAL)

    registry.add(artifact_copy(tmp_path, "cand-3"), trigger="alert", domain="science")
    registry.reject("cand-3", "accuracy below the active version's")
    with pytest.raises(RegistryError, match="rejected"):
        registry.promote("cand-3", "science")
    assert registry.get("cand-3").reason == "accuracy below the active version's"
    with pytest.raises(RegistryError, match="serving"):
        registry.reject(default, "no")
    with pytest.raises(RegistryError) as missing:
        registry.promote("nope")
    assert missing.value.status == 404
    assert [h["action"] for h in registry.history("science")] == ["rollback", "rollback", "promote", "promote"]

    # Another process (a second replica, the CLI) sees the same state.
    other = Registry(Database(database), tmp_path / "registry")
    assert other.active() == registry.active()


def test_a_corrupt_artifact_is_refused_at_registration(database, tmp_path):
    registry = Registry(Database(database), tmp_path / "registry")
    bad = artifact_copy(tmp_path, "bad-1")
    (bad / "alpha_head.safetensors").write_bytes(b"not a head")
    with pytest.raises(ArtifactError, match="do not match"):
        registry.add(bad, trigger="operator")
    assert registry.list() == [] and not (tmp_path / "registry" / "bad-1").exists()


def test_jobs_one_open_per_domain_leases_resume_and_give_up(database):
    clock = [1000.0]
    queue = JobQueue(Database(database), lease_s=60, max_attempts=2, clock=lambda: clock[0])
    job, created = queue.enqueue("science", "alert", {"fingerprint": "f1"})
    again, created_again = queue.enqueue("science", "alert", {"fingerprint": "f1"})
    assert created and not created_again and again.id == job.id  # a repeated alert reuses the open job
    clock[0] += 1
    other, _ = queue.enqueue("medicine", "operator")

    claimed = queue.claim("w1")
    assert claimed.id == job.id and claimed.status == "running" and claimed.attempts == 1
    assert queue.claim("w2").id == other.id
    assert queue.claim("w3") is None  # both leased
    assert queue.heartbeat(job.id, "w1", 0.5, "step 4")
    assert not queue.heartbeat(job.id, "w2")  # not w2's job

    clock[0] += 61  # w1 died: its lease ran out
    resumed = queue.claim("w3")
    assert resumed.id == job.id and resumed.worker == "w3" and resumed.attempts == 2
    assert any("resumed by w3" in line for line in resumed.log) and resumed.progress == 0.5
    assert not queue.heartbeat(job.id, "w1")  # the dead worker cannot take it back

    clock[0] += 61
    assert queue.claim("w4").id == other.id  # medicine's worker died too: second try
    clock[0] += 61
    assert queue.claim("w5") is None  # science used up its attempts: failed, not handed out again
    failed = queue.get(job.id)
    assert failed.status == "failed" and "gave up" in failed.log[-1]
    assert queue.enqueue("science", "alert")[1]  # a finished job frees the domain

    done = queue.finish(other.id, "promoted", candidate="v2", result={"gate": "ok"}, line="promoted")
    assert done.status == "promoted" and done.progress == 1.0 and done.result == {"gate": "ok"}
    assert [j.status for j in queue.list("medicine")] == ["promoted"]


def test_capture_is_opt_in_bounded_and_deletable(database):
    clock = [0.0]
    capture = Capture(Database(database), clock=lambda: clock[0])
    assert capture.settings() == {}
    off = CaptureSettings()
    assert not off.enabled and not off.include_answers  # the defaults: nothing kept, answers never

    on = capture.configure("science", CaptureSettings(enabled=True, max_items=3, max_age_s=100))
    for i in range(5):
        clock[0] += 1
        capture.add("science", on, [("multiple_choice", f"q{i}", ["a", "b"], "a")])
    kept = capture.prompts("science")
    assert [p.question for p in kept] == ["q2", "q3", "q4"]  # count bound: the newest 3
    assert all(p.answer is None for p in kept)  # answers only with include_answers

    capture.add_labelled("science", [("labelled q", ["x", "y"], 1)])
    clock[0] += 1
    capture.add("science", on, [("multiple_choice", "q5", ["a", "b"], None)])
    assert [p.question for p in capture.prompts("science", "labelled")] == ["labelled q"]  # traffic never pushes it out
    assert capture.prompts("science", "labelled")[0].answer == "1"

    clock[0] += 200  # age bound
    capture.add("science", on, [("free_form", "q6", None, None)])
    assert [p.question for p in capture.prompts("science")] == ["q6"]
    assert capture.counts() == {"science": 1}
    assert capture.delete("science") == 1 and capture.prompts("science") == []


def test_captured_prompts_become_unlabelled_calibration_questions_without_duplicates():
    from calm_core.capture import CapturedPrompt

    prompts = [CapturedPrompt("multiple_choice", "Q?", ("a", "b"), None, 0.0),
               CapturedPrompt("multiple_choice", "Q?", ("a", "b"), None, 1.0),
               CapturedPrompt("free_form", "F?", None, None, 2.0),
               CapturedPrompt("multiple_choice", "One option?", ("a",), None, 3.0)]
    questions = captured_questions(prompts, "science")
    assert [(q.question, q.choices, q.domain) for q in questions] == [("Q?", ("a", "b"), "science")]


def test_free_form_prompts_and_labels_become_open_questions_and_the_job_picks_its_modes(tmp_path):
    from calm_core.capture import Capture, CapturedPrompt
    from calm_core.splits import load_split, materialize
    from training.retrain.data import (
        captured_open_questions, job_split, labelled_open_questions, labelled_questions, traffic_counts,
        write_questions,
    )

    capture = Capture(Database(tmp_path / "c.sqlite3"))
    capture.add_labelled("trivia", [("Capital of France?", None, ["Paris", "City of Light"]),
                                    ("Pick", ["a", "b"], 1)])
    labelled = capture.prompts("trivia")
    opened = labelled_open_questions(labelled, "trivia")
    assert [(q.question, q.answers) for q in opened] == [("Capital of France?", ("Paris", "City of Light"))]
    assert [(q.question, q.answer) for q in labelled_questions(labelled, "trivia")] == [("Pick", 1)]

    prompts = [CapturedPrompt("free_form", "Who wrote Hamlet?", None, None, 0.0),
               CapturedPrompt("free_form", "Who wrote Hamlet?", None, None, 1.0),
               CapturedPrompt("free_form", "  ", None, None, 1.5),
               CapturedPrompt("multiple_choice", "Q?", ("a", "b"), None, 2.0)]
    open_questions = captured_open_questions(prompts, "trivia")
    assert [(q.question, q.answers) for q in open_questions] == [("Who wrote Hamlet?", ())]
    assert traffic_counts(prompts, "trivia") == {"multiple_choice": 1, "free_form": 1}

    # Captured free-form prompts are an open-ended split's unlabelled calibration set (a file source).
    calib = write_questions(tmp_path / "calibration.jsonl", open_questions)
    split = load_split(job_split("configs/splits/open-smoke.toml", "trivia", calib, tmp_path / "split.toml",
                                 open_ended=True))
    assert split.open_ended and split.calibration[0].open_ended and not split.calibration[0].labelled
    m = materialize(split)
    assert [q.question for q in m.role("calibration")] == ["Who wrote Hamlet?"]
    with pytest.raises(ConfigError, match="either multiple choice or open-ended"):
        job_split("configs/splits/smoke.toml", "trivia", calib, tmp_path / "mixed.toml", open_ended=True)


def test_a_candidate_takes_each_mode_from_its_retraining_or_else_from_the_parent(tmp_path):
    """Multiple-choice traffic only: the new multiple-choice mode with the parent's free-form mode; free-form only: the
    parent's multiple-choice mode with the new free-form mode; both: both new ones."""
    from calm_core.errors import CalmError
    from training.retrain.worker import Worker

    parent = load_artifact(artifact_copy(tmp_path, "parent"))
    new_mc = artifact_copy(tmp_path, "new-mc")  # told apart from the parent's mode by a metric only it has
    update_manifest(new_mc, free_form_version=None, metrics={"retrained": {"steps": 8.0}})
    shutil.rmtree(new_mc / "free_form")
    new_ff = tmp_path / "new-ff"
    shutil.copytree(SHIPPED / "free_form", new_ff)
    update_manifest(new_ff, artifact_version="new-ff")

    parent_ff = SHIPPED / "free_form"  # what the worker passes for a mode the job did not retrain
    got = {}
    for name, (mc, ff) in {"mc": (new_mc, parent_ff), "ff": (None, new_ff), "both": (new_mc, new_ff)}.items():
        (tmp_path / name).mkdir()
        out = load_artifact(Worker._assemble(tmp_path / name, parent, mc, ff))
        got[name] = ("retrained" in out.manifest.metrics, out.free_form.manifest.artifact_version)
    parent_version = parent.free_form.manifest.artifact_version
    assert got == {"mc": (True, parent_version), "ff": (False, "new-ff"), "both": (True, "new-ff")}
    with pytest.raises(CalmError, match="keeps the serving version's multiple-choice mode"):
        Worker._assemble(tmp_path, None, None, new_ff)


def test_a_job_retraining_both_modes_takes_the_stricter_gate():
    from training.retrain.gate import GateDecision, both

    promote, operator, reject = (GateDecision(o, (o,)) for o in ("promote", "operator", "reject"))
    assert both(promote, promote).outcome == "promote"
    assert both(promote, operator).outcome == "operator" and both(operator, promote).outcome == "operator"
    decision = both(reject, promote)
    assert decision.outcome == "reject" and decision.reasons == ("multiple choice: reject", "free form: promote")


@pytest.mark.parametrize("inputs, outcome, reason", [
    (GateInputs(0.50, 0.55), "reject", "accuracy 0.500 below"),
    (GateInputs(0.54, 0.55), "operator", "label-free"),
    (GateInputs(0.54, 0.55, 80, 0.05, 0.10), "promote", "ECE 0.050"),
    (GateInputs(0.60, 0.55, 80, 0.12, 0.10), "reject", "above the active version's"),
    (GateInputs(0.60, 0.55, 10, 0.30, 0.10), "operator", "10 labels"),  # too few labels to judge ECE on
    # A lower ECE bought with discrimination: AUROC on the test questions fell by more than the tolerance.
    (GateInputs(0.55, 0.55, candidate_auroc=0.545, active_auroc=0.642), "reject",
     "AUROC 0.545 below the active version's 0.642 - 0.02 on the test questions"),
    (GateInputs(0.55, 0.55, candidate_auroc=0.63, active_auroc=0.642), "operator", "AUROC 0.630 >= the active"),
    # Label-free: the candidate answers differently, or ranks its confidences differently, on the captured traffic.
    (GateInputs(0.55, 0.55, choice_agreement=0.80, confidence_correlation=0.99), "reject",
     "chosen option kept on 80.0% of the captured prompts (below 95%)"),
    (GateInputs(0.55, 0.55, choice_agreement=1.0, confidence_correlation=0.5), "reject",
     "confidence ranking correlation 0.500 with the active version's on the captured prompts (below 0.9)"),
    (GateInputs(0.55, 0.55, choice_agreement=0.99, confidence_correlation=0.95), "operator", "kept on 99.0%"),
    # With labels: a candidate whose ECE fell but whose AUROC on them fell too is rejected.
    (GateInputs(0.55, 0.55, 80, 0.05, 0.10, candidate_feedback_auroc=0.55, active_feedback_auroc=0.60), "reject",
     "AUROC 0.550 below the active version's 0.600 - 0.02 on 80 labels"),
    (GateInputs(0.55, 0.55, 80, 0.05, 0.10, candidate_feedback_auroc=0.59, active_feedback_auroc=0.60), "promote",
     "AUROC 0.590 >= the active version's 0.600 - 0.02 on 80 labels"),
])
def test_gate(inputs, outcome, reason):
    decision = gate(LoopConfig(accuracy_tolerance=0.02, min_feedback_labels=50), inputs)
    assert decision.outcome == outcome and any(reason in r for r in decision.reasons), decision


def test_a_loop_config_whose_jobs_could_never_have_enough_prompts_is_refused():
    with pytest.raises(ValueError, match=r"max_prompts \(40\) is below min_prompts \(120\)"):
        LoopConfig(min_prompts=120, max_prompts=40)


def test_gate_promotes_label_free_candidates_only_when_configured():
    cfg = LoopConfig(auto_promote_label_free=True)
    assert gate(cfg, GateInputs(0.6, 0.6)).outcome == "promote"
    assert gate(cfg, GateInputs(0.5, 0.6)).outcome == "reject"  # the accuracy gate still holds


def test_a_job_that_cannot_start_fails_with_its_reason_and_the_worker_goes_on(tmp_path):
    from training.retrain.worker import Worker

    db = Database(tmp_path / "g.sqlite3")
    worker = Worker(LoopConfig(train_config=str(tmp_path / "missing.toml"), runs_dir=str(tmp_path / "jobs")), db,
                    tmp_path / "registry", name="w")
    JobQueue(db).enqueue("science", "operator")
    JobQueue(db).enqueue("medicine", "operator")
    assert worker.run(once=True) == 2  # both taken, neither stopped the worker
    jobs = JobQueue(db).list()
    assert [j.status for j in jobs] == ["failed", "failed"]
    assert all("training config not found" in j.log[-1] for j in jobs)


def test_training_config_overrides_include_the_model():
    from training.config import load_config

    cfg = load_config("configs/train/loop-smoke.toml", model="/models/other", out_dir="/tmp/run", steps=None)
    assert cfg.model == "/models/other" and cfg.out_dir == "/tmp/run" and cfg.steps == 8


def test_a_label_free_job_waits_for_its_domains_captured_prompts_then_goes_on_with_them(tmp_path):
    """A drift alert fires on the first shifted answers: the job waits (its log says for what) while the traffic it
    is about is still being captured, and takes what arrived; without time left it takes what is there at once."""
    from training.retrain.worker import Heartbeat, Worker

    db = Database(tmp_path / "g.sqlite3")
    capture, queue = Capture(db), JobQueue(db)
    on = CaptureSettings(enabled=True)
    capture.add("science", on, [("multiple_choice", "Q0?", ["a", "b"], None)])
    worker = Worker(LoopConfig(min_prompts=3, capture_wait_s=600, runs_dir=str(tmp_path / "jobs")), db,
                    tmp_path / "registry", name="w", poll_s=0.02)
    queue.enqueue("science", "alert")
    job = queue.claim("w")
    beat = Heartbeat(queue, job, "w", tmp_path / "run", steps=1)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(worker._await_prompts, job, capture.prompts("science"), beat)
        wait_until("the job to say it waits", lambda: any(
            "waiting for captured prompts: 1 multiple-choice and 0 free-form, 3 of one kind needed" in line
            for line in queue.get(job.id).log), 30, 0.02)
        assert not waiting.done()
        capture.add("science", on, [("multiple_choice", f"Q{i}?", ["a", "b"], None) for i in (1, 2)])
        prompts = waiting.result(timeout=30)
    assert [p.question for p in prompts] == ["Q0?", "Q1?", "Q2?"]

    impatient = Worker(LoopConfig(min_prompts=5, capture_wait_s=0, runs_dir=str(tmp_path / "jobs")), db,
                       tmp_path / "registry", name="w", poll_s=0.02)
    assert len(impatient._await_prompts(job, prompts, beat)) == 3  # then `_modes` fails it, saying how many
