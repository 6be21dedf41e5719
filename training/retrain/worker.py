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

import json
import logging
import os
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from calm_core.artifact import FREE_FORM_DIR, attach_free_form, load_artifact, update_manifest
from calm_core.capture import Capture, CapturedPrompt, prompts_sha256
from calm_core.data import MCQuestion, load_mc_file
from calm_core.engine import EngineFactory
from calm_core.db import Database
from calm_core.errors import CalmError
from calm_core.jobs import Job, JobQueue
from calm_core.label_free import choice_movement
from calm_core.metrics import calibration_report
from calm_core.registry import Registry
from calm_core.models import resolve_model
from calm_core.served_answers import judged_choices, judged_free_form
from calm_core.splits import load_split, materialize
from calm_core.toml_config import dump_toml
from training.artifact_scoring import served_probabilities
from training.frozen_states import FrozenStates
from training.artifacts import reference_histogram
from training.config import load_config
from training.retrain.data import (
    FREE_FORM, MULTIPLE_CHOICE, captured_questions, job_split, labelled_open_questions, labelled_questions, traffic_counts,
    write_questions,
)
from training.retrain.free_form import retrain_free_form
from training.retrain.gate import GateInputs, LoopConfig, both, gate
from training.retrain.labelled import DomainLabels, job_method, recalibrate_modes
from training.trainer import Trainer

log = logging.getLogger("calm.worker")


# -- scoring and judging ---------------------------------------------------------------------------------------------
def metrics_of(probs: np.ndarray, questions: list[MCQuestion]) -> dict:
    """Accuracy, mean confidence, ECE, AUROC and Brier of one set's probabilities."""
    report = calibration_report(probs, np.array([q.answer for q in questions]), n_boot=20).as_dict()
    # AUROC is undefined when every answer is right (or wrong): None, so the metrics stay valid JSON.
    return {k: float(report[k]) if np.isfinite(report[k]) else None
            for k in ("n", "accuracy", "mean_confidence", "ece_10", "auroc", "brier")}


def judged_result(calibration: list[MCQuestion], tests: list[MCQuestion], judged: list[MCQuestion], n_labels: int,
                  candidate: tuple[np.ndarray, ...], active: tuple[np.ndarray, ...] | None) -> dict:
    """The gate's numbers of a multiple-choice candidate against the active version (None: the domain has none): on
    the test questions, on the uploaded labels (`judged`, when enough) and, label-free, how far it moved from the
    active version on the captured prompts (`calibration`). Each of `candidate` and `active` holds the option
    probabilities of those three sets, in that order."""
    candidate_m = metrics_of(candidate[1], tests)
    active_m = metrics_of(active[1], tests) if active else None
    inputs = {"candidate_accuracy": candidate_m["accuracy"], "active_accuracy": active_m["accuracy"] if active_m else 0.0,
              "feedback_labels": n_labels, "candidate_auroc": candidate_m["auroc"],
              "active_auroc": active_m["auroc"] if active_m else None}
    movement = {}
    if active:
        movement = asdict(choice_movement(active[0], candidate[0]))
        inputs.update(movement)
    feedback = {}
    if judged and active:
        feedback = {"candidate": metrics_of(candidate[2], judged), "active": metrics_of(active[2], judged)}
        inputs.update(candidate_feedback_ece=feedback["candidate"]["ece_10"],
                      active_feedback_ece=feedback["active"]["ece_10"],
                      candidate_feedback_auroc=feedback["candidate"]["auroc"],
                      active_feedback_auroc=feedback["active"]["auroc"])
    return {"captured_prompts": len(calibration), "in_domain": {"candidate": candidate_m, "active": active_m},
            "labels": feedback, "captured": movement, "inputs": asdict(GateInputs(**inputs))}


def judged_summary(in_domain: dict) -> str:
    """The test questions' numbers of candidate and active version, for the job's log."""
    cand, active = in_domain["candidate"], in_domain["active"] or {}
    number = lambda m, k: "n/a" if m.get(k) is None else f"{m[k]:.3f}"  # noqa: E731
    return ", ".join(f"{name} {number(cand, key)} (active {number(active, key)})" for name, key in (
        ("accuracy", "accuracy"), ("mean confidence", "mean_confidence"), ("ECE-10", "ece_10"), ("AUROC", "auroc")))


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
                 lease_s: float = 60.0, model: str | None = None, launcher: str | None = None,
                 engines: EngineFactory | None = None, registry_url: str | None = None, poll_s: float = 2.0):
        # engines: how free-form modes are scored as served (vLLM in process from `calm worker`)
        self.cfg, self.model, self.launcher, self.engines = cfg, model, launcher, engines
        self.queue = JobQueue(db, lease_s=lease_s)
        self.registry = Registry(db, registry_root, registry_url)
        self.capture = Capture(db)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.heartbeat_s = max(min(lease_s / 4, 5.0), 0.2)
        self.poll_s = poll_s  # how often an idle worker looks for a job, and a waiting job for captured prompts

    def run(self, once: bool = False) -> int:
        """Claim and run jobs until stopped (or, with `once`, until none is waiting); returns the jobs run."""
        done = 0
        while True:
            job = self.queue.claim(self.name)
            if job is None:
                if once:
                    return done
                time.sleep(self.poll_s)
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
        # Feedback verdicts on the serving version's answers are labels too (their scores as served were stored).
        db = self.registry.db
        labels = DomainLabels(labelled, judged_choices(db, domain, parent) if parent else [],
                              labelled_open_questions(prompts, domain),
                              judged_free_form(db, domain, parent) if parent else [])
        method = job_method(job.detail.get("method", self.cfg.method), max(labels.counts().values()),
                            self.cfg.min_recalibration_labels, domain)
        if method == "labelled":
            return self._recalibrate(job, job_dir, parent, labels, prompts, beat)
        prompts = self._await_prompts(job, prompts, beat)
        modes = self._modes(domain, prompts)
        parent_artifact = load_artifact(self.registry.path_of(parent)) if parent else None
        parent_ff = (parent_artifact.path / FREE_FORM_DIR if parent_artifact is not None
                     and parent_artifact.manifest.free_form_version is not None else None)
        result, confidences, mc_dir, ff_dir = {"parent": parent, "modes": modes}, [], None, None
        if MULTIPLE_CHOICE in modes:
            mc_dir, mc_result, mc_confidences = self._multiple_choice(domain, job_dir, train_cfg, parent_artifact,
                                                                      prompts, labelled, beat)
            result.update(mc_result)
            confidences.append(mc_confidences)
        if FREE_FORM in modes:
            ff = retrain_free_form(self.cfg.free_form(domain), job_dir, domain, parent_ff, prompts, self.model,
                                   self._engine_factory(), lambda cfg: self._train(cfg, beat), beat.note,
                                   latest=lambda: self.capture.prompts(domain))
            result.update({FREE_FORM: ff.result} if mc_dir else ff.result)
            confidences.append(ff.captured_confidences)
            ff_dir = ff.artifact
        candidate_dir = self._assemble(job_dir, parent_artifact, mc_dir, ff_dir or parent_ff)
        # The candidate's reference for this domain: its own confidences on the domain's captured traffic.
        manifest = load_artifact(candidate_dir).manifest
        update_manifest(candidate_dir, reference_histograms={
            **manifest.reference_histograms, domain: reference_histogram(np.concatenate(confidences))})
        trigger = job.trigger if job.trigger in ("alert", "operator", "schedule") else "operator"
        record = self.registry.add(candidate_dir, trigger=trigger, domain=domain, parent=parent, job_id=job.id,
                                   calibration_sha256=prompts_sha256([p for p in prompts if p.kind in modes]),
                                   metrics=result)
        self.queue.set_candidate(job.id, record.version)
        return self._decide(job, record.version, result, beat)

    def _await_prompts(self, job: Job, prompts: list[CapturedPrompt], beat: Heartbeat) -> list[CapturedPrompt]:
        """The domain's captured prompts once one kind has `min_prompts` of them, or as they are when the job has waited
        `capture_wait_s` since it was queued (then `_modes` fails it, saying how many there are)."""
        deadline = job.created_at + self.cfg.capture_wait_s
        counts, noted = traffic_counts(prompts, job.domain), float("-inf")
        while max(counts.values()) < self.cfg.min_prompts and time.time() < deadline:
            if time.monotonic() - noted >= 30:  # a line now and then, not one per prompt (the log keeps 50)
                beat.note(f"waiting for captured prompts: {counts[MULTIPLE_CHOICE]} multiple-choice and "
                          f"{counts[FREE_FORM]} free-form, {self.cfg.min_prompts} of one kind needed")
                noted = time.monotonic()
            time.sleep(min(self.poll_s, max(deadline - time.time(), 0)))
            prompts = self.capture.prompts(job.domain)
            counts = traffic_counts(prompts, job.domain)
        return prompts

    def _modes(self, domain: str, prompts: list[CapturedPrompt]) -> list[str]:
        """The modes the domain's captured traffic can retrain: each with at least `min_prompts` distinct prompts."""
        counts = traffic_counts(prompts, domain)
        modes = [mode for mode, n in counts.items() if n >= self.cfg.min_prompts]
        if not modes:
            raise CalmError(f"{counts[MULTIPLE_CHOICE]} captured multiple-choice and {counts[FREE_FORM]} free-form "
                            f"prompts in domain {domain!r}; the job needs {self.cfg.min_prompts} of one kind "
                            f"(enable capture: PUT /admin/capture/{domain})")
        return modes

    def _engine_factory(self) -> EngineFactory:
        if self.engines is None:
            raise CalmError("judging a free-form mode needs an engine (calm worker passes vLLM in process)")
        return self.engines

    def _multiple_choice(self, domain: str, job_dir: Path, train_cfg, parent_artifact, prompts: list[CapturedPrompt],
                         labelled: list[MCQuestion], beat: Heartbeat) -> tuple[Path, dict, np.ndarray]:
        """CALM on the captured multiple-choice prompts; the exported artifact, its judged metrics and its confidences
        on the captured prompts."""
        calib_file = self._calibration_file(domain, prompts, job_dir)
        calibration = load_mc_file(calib_file)
        tests = [s for s in self.cfg.test_sets.get(domain, []) if not s.is_open] or None
        split_path = job_split(train_cfg.split, domain, calib_file, job_dir / "split.toml", tests)
        start = str(parent_artifact.path) if parent_artifact is not None and self.cfg.warm_start else None
        train_cfg = train_cfg.model_copy(update={"split": str(split_path), "init_from": start})
        beat.note(f"parent {parent_artifact.manifest.artifact_version if parent_artifact else None}; "
                  f"{len(calibration)} captured prompts as the calibration set", "training")

        exported, trainer = self._run_training(train_cfg, beat)
        # The frozen bottom's states of the captured and test questions as training encoded them: the versions judged
        # below run their top layers from them. The trainer itself (model, optimizer) goes now.
        frozen = None if trainer is None else FrozenStates.of_sets(trainer.model, trainer.first_trained, trainer.sets)
        del trainer
        beat.note("trained; judging the candidate" + (f" from the states training encoded below layer {frozen.layer} "
                                                      f"({len(frozen.states)} questions)" if frozen else ""), "judging")
        model_path = str(resolve_model(train_cfg.model).path)
        tests = materialize(load_split(split_path)).role("test_in_domain")
        judged = labelled if len(labelled) >= self.cfg.min_feedback_labels and parent_artifact is not None else []
        # One load of the weights per version for everything it is scored on; a head-only candidate shares its
        # parent's (and each question's forward pass). Both run their top layers from the states training encoded.
        versions = [load_artifact(exported)] + ([parent_artifact] if parent_artifact else [])
        scored = served_probabilities(versions, model_path, calibration, tests, judged, frozen=frozen)
        cand_calib, cand_tests, cand_labels = scored[0]
        active = tuple(scored[1]) if parent_artifact else None
        result = judged_result(calibration, tests, judged, len(labelled), (cand_calib, cand_tests, cand_labels), active)
        return exported, result, cand_calib.max(axis=1)

    @staticmethod
    def _assemble(job_dir: Path, parent_artifact, mc_dir: Path | None, ff_dir: Path | None) -> Path:
        """The candidate version: its multiple-choice mode (retrained, else the parent's) with its free-form mode (the
        retrained or the parent's one; none: the multiple-choice artifact alone)."""
        if mc_dir is None and parent_artifact is None:
            raise CalmError("a free-form job keeps the serving version's multiple-choice mode; the domain has none")
        mc = mc_dir or parent_artifact.path
        if ff_dir is None:
            return mc
        attach_free_form(mc, ff_dir, job_dir / "candidate")
        return job_dir / "candidate"

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

    def _recalibrate(self, job: Job, job_dir: Path, parent: str | None, labels: DomainLabels,
                     prompts: list[CapturedPrompt], beat: Heartbeat) -> Job:
        if parent is None:
            raise CalmError(f"domain {job.domain!r} has no serving version to recalibrate")
        beat.note(f"parent {parent}; fitting the labelled maps: {len(labels.multiple_choice)} multiple-choice and "
                  f"{len(labels.free_form)} free-form questions uploaded, {len(labels.judged_choices)} and "
                  f"{len(labels.judged_free_form)} answers judged by feedback", "judging")
        # An engine scores uploaded free-form questions (greedy answers as served); judged answers come with theirs.
        result, written = recalibrate_modes(self.registry.path_of(parent), parent, labels, job.domain, job_dir,
                                            self.cfg.min_recalibration_labels, self.engines)
        if not written:  # a held-out check failed: nothing to register
            reasons = [r["reason"] for r in (result, result.get(FREE_FORM) or {}) if r and "version" not in r]
            return self.queue.finish(job.id, "rejected", result=result, line=f"rejected: {'; '.join(reasons)}")
        trigger = job.trigger if job.trigger in ("alert", "operator", "schedule") else "operator"
        record = self.registry.add(job_dir / "candidate", trigger=trigger, domain=job.domain, parent=parent,
                                   job_id=job.id, metrics=result,
                                   calibration_sha256=prompts_sha256([p for p in prompts if p.kind == "labelled"]))
        self.queue.set_candidate(job.id, record.version)
        return self._decide(job, record.version, result, beat)

    def _train(self, train_cfg, beat: Heartbeat) -> Path:
        """The exported artifact of _run_training."""
        return self._run_training(train_cfg, beat)[0]

    def _run_training(self, train_cfg, beat: Heartbeat) -> tuple[Path, Trainer | None]:
        """CALM on the job's split, resumed from its checkpoint if a worker died mid-run; the exported artifact, and the
        trainer when it ran in this process (None under `launcher`).
        In this process, or with `launcher` (e.g. `accelerate launch --num_processes 4`) as `calm train` under it."""
        if self.launcher:
            config = Path(train_cfg.out_dir).parent / "train.toml"
            config.write_text(dump_toml(train_cfg.model_dump(exclude_none=True)))
            argv = [*shlex.split(self.launcher), "-m", "calm_cli", "train", "--config", str(config)]
            beat.note("training: " + " ".join(argv))
            with open(Path(train_cfg.out_dir).parent / "train.out", "a") as out:
                subprocess.run(argv, check=True, stdout=out, stderr=subprocess.STDOUT)
            return Path(train_cfg.out_dir) / "artifact", None
        trainer = Trainer(train_cfg, show_progress=False).setup()
        if trainer.resume():
            beat.note(f"resumed from the checkpoint at step {trainer.step}")
        trainer.train()
        return trainer.export(), trainer

    def _decide(self, job: Job, version: str, result: dict, beat: Heartbeat) -> Job:
        decision = gate(self.cfg, GateInputs(**result["inputs"]))
        if FREE_FORM in result:  # both modes retrained: both must pass
            decision = both(decision, gate(self.cfg, GateInputs(**result[FREE_FORM]["inputs"])))
        result = {**result, "gate": decision.as_dict()}
        summary = f"candidate {version}: {judged_summary(result['in_domain'])}; {decision.outcome}: {'; '.join(decision.reasons)}"
        beat.note(summary)
        if decision.outcome == "promote":
            self.registry.promote(version, job.domain, actor=f"worker {self.name}")
            return self.queue.finish(job.id, "promoted", candidate=version, result=result, line="promoted")
        if decision.outcome == "reject":
            self.registry.reject(version, "; ".join(decision.reasons))
            return self.queue.finish(job.id, "rejected", candidate=version, result=result, line="rejected")
        return self.queue.finish(job.id, "awaiting_operator", candidate=version, result=result,
                                 line="awaiting the operator (calm artifacts promote)")
