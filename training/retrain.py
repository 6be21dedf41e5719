"""The retraining worker (`calm worker`): turns a queued job into a CALM candidate for one domain, judges it, and
promotes it or not. It runs beside the gateway, never inside it, and shares only the database and the registry folder.

One job, step by step (each step's output lies in the job's folder, so a job resumed after a crash repeats only what
was not finished):

1. the domain's captured multiple-choice prompts become the *unlabelled* calibration set (CALM's upper level needs no
   labels); the loop's training config gives the labelled training set; the domain's labelled test questions (loop
   config) are the in-domain test set;
2. CALM trains (the same Trainer as `calm train`; checkpoints every few steps, resumed after a crash);
3. the candidate gets a reference histogram of its own confidences on the domain's captured traffic (so the drift
   gauge of the domain measures against what this version expects) and keeps the parent's free-form mode;
4. the candidate and the version serving the domain now are scored by one rule (training/artifact_scoring.py) on the
   domain's labelled test questions and, when the domain has enough of them, on its labelled questions uploaded
   through /admin/labels (used to judge only, never to train);
5. the gate decides (`gate`, a pure function); the candidate is registered either way, promoted, left for the
   operator, or rejected with the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from calm_core.artifact import FREE_FORM_DIR, attach_free_form, load_artifact, update_manifest
from calm_core.capture import Capture, CapturedPrompt, prompts_sha256
from calm_core.data import MAX_OPTIONS, MIN_OPTIONS, MCQuestion, load_mc_file
from calm_core.db import Database
from calm_core.errors import CalmError
from calm_core.jobs import Job, JobQueue
from calm_core.metrics import calibration_report
from calm_core.registry import Registry
from calm_core.models import resolve_model
from calm_core.splits import SourceSpec, load_split, materialize
from calm_core.toml_config import dump_toml, load_toml_model
from training.artifact_scoring import load_served_model, option_probabilities
from training.artifacts import reference_histogram
from training.config import load_config
from training.retrain_labelled import JobMethod, job_method, labelled_result, recalibrate_for_job
from training.scoring import load_tokenizer
from training.trainer import Trainer

log = logging.getLogger("calm.worker")


class LoopConfig(BaseModel):
    """configs/loop.toml: what a retraining job trains and how its candidate is judged."""

    model_config = ConfigDict(extra="forbid")

    train_config: str = "configs/train/loop.toml"  # method and schedule; its split's train role is the labelled set
    runs_dir: str = "runs/jobs"
    min_prompts: int = Field(30, ge=1)  # fewer captured multiple-choice prompts: the job fails, saying so
    max_prompts: int = Field(2000, ge=1)  # the newest ones are used
    accuracy_tolerance: float = 0.02  # candidate accuracy >= active's - this, on the domain's labelled test questions
    ece_tolerance: float = 0.0  # candidate ECE <= active's + this, on the domain's uploaded labels (when enough)
    min_feedback_labels: int = Field(50, ge=1)
    auto_promote_label_free: bool = False  # without enough labels: promote anyway (else the operator decides)
    # auto: the labelled map (training/retrain_labelled.py) where the domain has `min_recalibration_labels` uploaded
    # labelled questions, else label-free CALM; a job may ask for either (POST /admin/jobs {"method": ...}).
    method: JobMethod = "auto"
    min_recalibration_labels: int = Field(100, ge=10)
    # Continue from the version serving the domain (its adapter and head) rather than from the base model: a retrain
    # adjusts what serves to the domain's traffic in a few steps instead of relearning it. Needs the training config's
    # LoRA shape to be the parent's.
    warm_start: bool = True
    # Per domain: labelled in-domain test questions. A domain not listed uses the training split's in-domain tests.
    test_sets: dict[str, list[SourceSpec]] = {}


def load_loop_config(path: str | Path, **overrides) -> LoopConfig:
    return load_toml_model(path, LoopConfig, "loop config", **overrides)


# -- the gate (pure) -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GateInputs:
    candidate_accuracy: float
    active_accuracy: float
    feedback_labels: int = 0
    candidate_feedback_ece: float | None = None
    active_feedback_ece: float | None = None


@dataclass(frozen=True)
class GateDecision:
    outcome: str  # promote | operator | reject
    reasons: tuple[str, ...]

    def as_dict(self) -> dict:
        return {"outcome": self.outcome, "reasons": list(self.reasons)}


def gate(cfg: LoopConfig, m: GateInputs) -> GateDecision:
    reasons = []
    floor = m.active_accuracy - cfg.accuracy_tolerance
    if m.candidate_accuracy < floor:
        return GateDecision("reject", (f"accuracy {m.candidate_accuracy:.3f} below the active version's "
                                       f"{m.active_accuracy:.3f} - {cfg.accuracy_tolerance:g}",))
    reasons.append(f"accuracy {m.candidate_accuracy:.3f} >= {floor:.3f} (active {m.active_accuracy:.3f})")
    if m.feedback_labels >= cfg.min_feedback_labels:
        limit = m.active_feedback_ece + cfg.ece_tolerance
        if m.candidate_feedback_ece > limit:
            return GateDecision("reject", (*reasons, f"ECE {m.candidate_feedback_ece:.3f} on {m.feedback_labels} labels "
                                           f"above the active version's {m.active_feedback_ece:.3f}"))
        reasons.append(f"ECE {m.candidate_feedback_ece:.3f} <= {limit:.3f} on {m.feedback_labels} labels")
        return GateDecision("promote", tuple(reasons))
    reasons.append(f"{m.feedback_labels} labels of the domain (< {cfg.min_feedback_labels}): label-free")
    if cfg.auto_promote_label_free:
        return GateDecision("promote", (*reasons, "auto_promote_label_free is set"))
    return GateDecision("operator", (*reasons, "promotion is the operator's call (calm artifacts promote)"))


# -- data for one job ------------------------------------------------------------------------------------------------
def captured_questions(prompts: list[CapturedPrompt], domain: str) -> list[MCQuestion]:
    """Captured multiple-choice prompts as unlabelled questions (answer 0 is a placeholder), duplicates removed."""
    seen, out = set(), []
    for p in prompts:
        if p.kind != "multiple_choice" or not p.options or not MIN_OPTIONS <= len(p.options) <= MAX_OPTIONS:
            continue
        key = hashlib.sha256(json.dumps([p.question, list(p.options)]).encode()).hexdigest()[:16]
        if key not in seen:
            seen.add(key)
            out.append(MCQuestion(f"captured-{key}", f"captured:{domain}", "live", p.question, tuple(p.options), 0, domain))
    return out


def labelled_questions(prompts: list[CapturedPrompt], domain: str) -> list[MCQuestion]:
    """Questions an operator uploaded with their answers (/admin/labels)."""
    out = []
    for i, p in enumerate(prompts):
        if p.kind == "labelled" and p.options and p.answer is not None and p.answer.isdigit() and int(p.answer) < len(p.options):
            out.append(MCQuestion(f"labelled-{i}", f"labelled:{domain}", "live", p.question, tuple(p.options), int(p.answer), domain))
    return out


def write_questions(path: Path, questions: list[MCQuestion]) -> Path:
    rows = [{"id": q.id, "dataset": q.dataset, "split": q.split, "question": q.question, "choices": list(q.choices),
             "answer": q.answer, "domain": q.domain} for q in questions]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)
    return path


def job_split(cfg: LoopConfig, train_split_path: str, domain: str, calibration_file: Path, out: Path) -> Path:
    """The job's split: the training config's labelled training set and out-of-domain tests, the domain's captured
    prompts as calibration, the domain's labelled questions as in-domain tests."""
    base = load_split(train_split_path)
    tests = cfg.test_sets.get(domain) or base.test_in_domain
    split = base.model_copy(update={
        "name": f"retrain-{domain}",
        "calibration": [SourceSpec(dataset=f"captured:{domain}", split="live", path=str(calibration_file), labelled=False)],
        "test_in_domain": tests,
    })
    out.write_text(dump_toml(split.model_dump(mode="json", exclude_none=True)), encoding="utf-8")
    load_split(out)  # what was written reads back as a valid split
    return out


# -- scoring and judging ---------------------------------------------------------------------------------------------
def served_probabilities(artifact_dir: Path, model_path: str, *question_sets: list[MCQuestion]) -> list[np.ndarray]:
    """Each set's option probabilities under an artifact, scored as the gateway serves it; the model loads once."""
    tokenizer = load_tokenizer(model_path)
    artifact = load_artifact(artifact_dir)
    model = load_served_model(model_path, artifact.adapter_dir)
    manifest = artifact.manifest
    return [option_probabilities(model, tokenizer, qs, manifest.answer_format, artifact.head,
                                 option_temperature=manifest.option_temperature) if qs else
            np.zeros((0, 0)) for qs in question_sets]


def metrics_of(probs: np.ndarray, questions: list[MCQuestion]) -> dict:
    """Accuracy, mean confidence, ECE, AUROC and Brier of one set's probabilities."""
    report = calibration_report(probs, np.array([q.answer for q in questions]), n_boot=20).as_dict()
    # AUROC is undefined when every answer is right (or wrong): None, so the metrics stay valid JSON.
    return {k: float(report[k]) if np.isfinite(report[k]) else None
            for k in ("n", "accuracy", "mean_confidence", "ece_10", "auroc", "brier")}


# -- the worker ------------------------------------------------------------------------------------------------------
class Heartbeat:
    """Renews a job's lease every `every_s` seconds while it runs, with progress read from the run's training log."""

    def __init__(self, queue: JobQueue, job: Job, worker: str, run_dir: Path, steps: int, every_s: float = 2.0):
        self.queue, self.job, self.worker, self.run_dir, self.steps, self.every_s = queue, job, worker, run_dir, steps, every_s
        self.stage = "preparing"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _progress(self) -> float:
        """0.1 for preparing, 0.1-0.8 for training (by step), 0.8-1.0 for judging."""
        if self.stage == "judging":
            return 0.9
        try:
            lines = (self.run_dir / "train_log.jsonl").read_text().splitlines()
            step = json.loads(lines[-1])["step"] if lines else 0
        except (OSError, ValueError, KeyError):
            step = 0
        return 0.1 + 0.7 * min(step / self.steps, 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.queue.heartbeat(self.job.id, self.worker, self._progress())
            except Exception as e:  # a database hiccup: try again next beat (the lease is longer than a beat)
                log.warning("heartbeat failed: %s", e)

    def note(self, line: str, stage: str | None = None) -> None:
        self.stage = stage or self.stage
        self.queue.heartbeat(self.job.id, self.worker, self._progress(), line)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        return False


class Worker:
    def __init__(self, cfg: LoopConfig, db: Database, registry_root: Path, name: str | None = None,
                 lease_s: float = 60.0, model: str | None = None, launcher: str | None = None):
        self.cfg, self.model, self.launcher = cfg, model, launcher
        self.queue = JobQueue(db, lease_s=lease_s)
        self.registry = Registry(db, registry_root)
        self.capture = Capture(db)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat_s = max(min(lease_s / 4, 5.0), 0.2)

    def run(self, once: bool = False, poll_s: float = 2.0) -> int:
        """Claim and run jobs until stopped (or, with `once`, until none is waiting); returns the jobs run."""
        done = 0
        while True:
            job = self.queue.claim(self.name)
            if job is None:
                if once:
                    return done
                time.sleep(poll_s)
                continue
            self.run_job(job)
            done += 1

    def run_job(self, job: Job) -> Job:
        job_dir = Path(self.cfg.runs_dir) / job.id
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            train_cfg = load_config(self.cfg.train_config, out_dir=str(job_dir / "run"), model=self.model)
            with Heartbeat(self.queue, job, self.name, job_dir / "run", train_cfg.steps, self.heartbeat_s) as beat:
                return self._run(job, job_dir, train_cfg, beat)
        except Exception as e:  # the job fails with its reason; the worker goes on to the next one
            log.exception("job %s failed", job.id)
            return self.queue.finish(job.id, "failed", line=f"failed: {type(e).__name__}: {e}")

    def _run(self, job: Job, job_dir: Path, train_cfg, beat: Heartbeat) -> Job:
        domain = job.domain
        if job.candidate is not None:  # registered before a crash: judge it, do not train another
            record = self.registry.get(job.candidate)
            return self._decide(job, record.version, record.metrics, beat)
        parent = self.registry.serving(domain)
        prompts = self.capture.prompts(domain)
        labelled = labelled_questions(prompts, domain)
        method = job_method(job.detail.get("method", self.cfg.method), len(labelled), self.cfg.min_recalibration_labels,
                            domain)
        if method == "labelled":
            return self._recalibrate(job, job_dir, parent, labelled, prompts, beat)
        calib_file = self._calibration_file(domain, prompts, job_dir)
        calibration = load_mc_file(calib_file)
        split_path = job_split(self.cfg, train_cfg.split, domain, calib_file, job_dir / "split.toml")
        start = str(self.registry.path_of(parent)) if parent and self.cfg.warm_start else None
        train_cfg = train_cfg.model_copy(update={"split": str(split_path), "init_from": start})
        beat.note(f"parent {parent}; {len(calibration)} captured prompts as the calibration set", "training")

        exported = self._train(train_cfg, job_dir, beat)
        beat.note("trained; judging the candidate", "judging")
        model_path = str(resolve_model(train_cfg.model).path)
        tests = materialize(load_split(split_path)).role("test_in_domain")

        parent_artifact = load_artifact(self.registry.path_of(parent)) if parent else None
        judged = labelled if len(labelled) >= self.cfg.min_feedback_labels and parent_artifact is not None else []
        # One load of the candidate's weights for everything it is scored on (attaching the free-form mode below
        # leaves its adapter and head as they are), one of the active version's.
        cand_calib, cand_tests, cand_labels = served_probabilities(exported, model_path, calibration, tests, judged)
        active_tests, active_labels = (served_probabilities(parent_artifact.path, model_path, tests, judged)
                                       if parent_artifact else (None, None))

        # The candidate's reference for this domain: its own confidences on the domain's captured traffic.
        manifest = load_artifact(exported).manifest
        update_manifest(exported, reference_histograms={**manifest.reference_histograms,
                                                        domain: reference_histogram(cand_calib.max(axis=1))})
        candidate_dir = exported
        if parent_artifact is not None and parent_artifact.manifest.free_form_version is not None:
            candidate_dir = job_dir / "candidate"  # the parent's free-form mode goes on serving free-form answers
            attach_free_form(exported, parent_artifact.path / FREE_FORM_DIR, candidate_dir)

        active_m = metrics_of(active_tests, tests) if parent_artifact else None
        candidate_m = metrics_of(cand_tests, tests)
        inputs = GateInputs(candidate_m["accuracy"], active_m["accuracy"] if active_m else 0.0, len(labelled))
        feedback = {}
        if judged:
            feedback = {"candidate": metrics_of(cand_labels, judged), "active": metrics_of(active_labels, judged)}
            inputs = GateInputs(inputs.candidate_accuracy, inputs.active_accuracy, len(labelled),
                                feedback["candidate"]["ece_10"], feedback["active"]["ece_10"])
        result = {"parent": parent, "captured_prompts": len(calibration),
                  "in_domain": {"candidate": candidate_m, "active": active_m}, "labels": feedback,
                  "inputs": asdict(inputs)}
        trigger = job.trigger if job.trigger in ("alert", "operator", "schedule") else "operator"
        record = self.registry.add(candidate_dir, trigger=trigger, domain=domain, parent=parent, job_id=job.id,
                                   calibration_sha256=prompts_sha256([p for p in prompts if p.kind == "multiple_choice"]),
                                   metrics=result)
        self.queue.set_candidate(job.id, record.version)
        return self._decide(job, record.version, result, beat)

    def _calibration_file(self, domain: str, prompts: list[CapturedPrompt], job_dir: Path) -> Path:
        """The domain's newest captured multiple-choice prompts, the label-free job's calibration set."""
        calibration = captured_questions(prompts, domain)[-self.cfg.max_prompts:]
        if len(calibration) < self.cfg.min_prompts:
            raise CalmError(f"{len(calibration)} captured multiple-choice prompts in domain {domain!r}; the job needs "
                            f"{self.cfg.min_prompts} (enable capture: PUT /admin/capture/{domain})")
        calib_file = job_dir / "calibration.jsonl"
        if not calib_file.is_file():  # a resumed job keeps the prompts it started with
            write_questions(calib_file, calibration)
        return calib_file

    def _recalibrate(self, job: Job, job_dir: Path, parent: str | None, labelled: list[MCQuestion],
                     prompts: list[CapturedPrompt], beat: Heartbeat) -> Job:
        if parent is None:
            raise CalmError(f"domain {job.domain!r} has no serving version to recalibrate")
        beat.note(f"parent {parent}; fitting the labelled map on {len(labelled)} labelled questions", "judging")
        labels_file = write_questions(job_dir / "labels.jsonl", labelled)
        summary = recalibrate_for_job(self.registry.path_of(parent), labels_file, job.domain, job_dir / "candidate")
        result = labelled_result(summary, parent, labelled)
        if "version" not in summary:  # the held-out check failed: nothing to register
            return self.queue.finish(job.id, "rejected", result=result, line=f"rejected: {summary['reason']}")
        trigger = job.trigger if job.trigger in ("alert", "operator", "schedule") else "operator"
        record = self.registry.add(job_dir / "candidate", trigger=trigger, domain=job.domain, parent=parent,
                                   job_id=job.id, metrics=result,
                                   calibration_sha256=prompts_sha256([p for p in prompts if p.kind == "labelled"]))
        self.queue.set_candidate(job.id, record.version)
        return self._decide(job, record.version, result, beat)

    def _train(self, train_cfg, job_dir: Path, beat: Heartbeat) -> Path:
        """CALM on the job's split, resumed from its checkpoint if a worker died mid-run; the exported artifact.
        In this process, or with `launcher` (e.g. `accelerate launch --num_processes 4`) as `calm train` under it."""
        if self.launcher:
            config = job_dir / "train.toml"
            config.write_text(dump_toml(train_cfg.model_dump(exclude_none=True)))
            argv = [*shlex.split(self.launcher), "-m", "calm_cli", "train", "--config", str(config)]
            beat.note("training: " + " ".join(argv))
            with open(job_dir / "train.out", "a") as out:
                subprocess.run(argv, check=True, stdout=out, stderr=subprocess.STDOUT)
            return Path(train_cfg.out_dir) / "artifact"
        trainer = Trainer(train_cfg, show_progress=False).setup()
        if trainer.resume():
            beat.note(f"resumed from the checkpoint at step {trainer.step}")
        trainer.train()
        return trainer.export()

    def _decide(self, job: Job, version: str, result: dict, beat: Heartbeat) -> Job:
        decision = gate(self.cfg, GateInputs(**result["inputs"]))
        result = {**result, "gate": decision.as_dict()}
        cand, active = result["in_domain"]["candidate"], result["in_domain"]["active"] or {}
        summary = (f"candidate {version}: accuracy {cand['accuracy']:.3f} (active {active.get('accuracy', float('nan')):.3f}), "
                   f"ECE-10 {cand['ece_10']:.3f} (active {active.get('ece_10', float('nan')):.3f}); "
                   f"{decision.outcome}: {'; '.join(decision.reasons)}")
        beat.note(summary)
        if decision.outcome == "promote":
            self.registry.promote(version, job.domain, actor=f"worker {self.name}")
            return self.queue.finish(job.id, "promoted", candidate=version, result=result, line="promoted")
        if decision.outcome == "reject":
            self.registry.reject(version, "; ".join(decision.reasons))
            return self.queue.finish(job.id, "rejected", candidate=version, result=result, line="rejected")
        return self.queue.finish(job.id, "awaiting_operator", candidate=version, result=result,
                                 line="awaiting the operator (calm artifacts promote)")
