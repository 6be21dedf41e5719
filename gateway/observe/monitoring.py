"""Prometheus metrics per domain on an injected registry, and the per-domain drift and feedback state behind them.

Domain labels are bounded: known domains (the artifact's reference domains plus configured ones) and `other`.
No prompt text ever reaches a label or a log line.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from calm_core.artifact import ReferenceHistogram
from calm_core.domains import OTHER, known_domains
from gateway.observe.drift import ConfidenceWindow
from gateway.observe.online_calibration import online_accuracy_and_ece

_CONF_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 21))
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ENTROPY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter("calm_requests_total", "Requests by endpoint, domain and status", ["endpoint", "domain", "status"], registry=registry)
        self.errors = Counter("calm_errors_total", "Failed requests by endpoint, domain and error type", ["endpoint", "domain", "type"], registry=registry)
        self.latency = Histogram("calm_request_latency_seconds", "End-to-end latency", ["endpoint", "domain"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.confidence = Histogram("calm_confidence", "Calibrated confidence of answers", ["domain"], buckets=_CONF_BUCKETS, registry=registry)
        self.entropy = Histogram("calm_predictive_entropy_nats", "Predictive entropy of answers", ["domain"], buckets=_ENTROPY_BUCKETS, registry=registry)
        self.abstentions = Counter("calm_abstentions_total", "Answers withheld by an abstain policy", ["domain"], registry=registry)
        self.answers = Counter("calm_answers_total", "Answers produced (abstained or not)", ["domain"], registry=registry)
        self.below_threshold = Counter("calm_below_threshold_total", "Answers below their policy threshold (abstained or annotated)", ["domain"], registry=registry)
        self.drift_psi = Gauge("calm_drift_psi", "PSI of the live confidence window against the artifact reference", ["domain"], registry=registry)
        self.drift_ks = Gauge("calm_drift_ks", "KS statistic of the live confidence window against the reference", ["domain"], registry=registry)
        self.window = Gauge("calm_drift_window_size", "Answers in the live confidence window", ["domain"], registry=registry)
        self.reference_confidence = Gauge("calm_reference_confidence_mean", "Mean confidence of the serving version's "
                                          "reference histogram for the domain (what drift is measured against)",
                                          ["domain"], registry=registry)
        self.in_flight = Gauge("calm_requests_in_flight", "Generation requests being served (streams until their last "
                               "chunk); at CALM_MAX_IN_FLIGHT more are answered 429", registry=registry)
        self.est_accuracy = Gauge("calm_estimated_accuracy", "Mean calibrated confidence over the live window (label-free accuracy estimate)", ["domain"], registry=registry)
        self.feedback = Counter("calm_feedback_total", "Feedback received", ["domain", "correct"], registry=registry)
        self.online_accuracy = Gauge("calm_online_accuracy", "Accuracy from feedback (recent window)", ["domain"], registry=registry)
        self.online_ece = Gauge("calm_online_ece", "10-bin ECE from feedback (recent window)", ["domain"], registry=registry)
        self.policy_threshold = Gauge("calm_policy_guaranteed_threshold", "Threshold of the domain's guaranteed-risk policy (1 = abstain on all)", ["domain"], registry=registry)
        self.policy_labels = Gauge("calm_policy_guarantee_labels", "Labelled answers behind the guaranteed threshold", ["domain"], registry=registry)
        self.policy_realised_risk = Gauge("calm_policy_realised_selective_risk", "Error rate of the answers let through, on feedback since the last fit", ["domain"], registry=registry)
        self.policy_realised_answers = Gauge("calm_policy_realised_answers", "Answers let through with feedback since the last fit", ["domain"], registry=registry)
        self.serving_version = Gauge("calm_serving_version_info", "The artifact version serving each domain (value 1)",
                                     ["domain", "version"], registry=registry)
        self.feedback_count = Gauge("calm_online_feedback_window", "Feedback items in the online window", ["domain"], registry=registry)
        self.escalations = Counter("calm_escalations_total", "Answers below an escalate policy's threshold by outcome: "
                                   "escalated (the target's answer served), fallback_annotate, fallback_abstain",
                                   ["domain", "outcome"], registry=registry)
        self.escalation_latency = Histogram("calm_escalation_target_seconds", "Time the escalation target took, answered "
                                            "or failed", ["domain"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.escalation_errors = Counter("calm_escalation_errors_total", "Escalation target failures by reason (timeout, "
                                         "connect, status, invalid, api_key)", ["domain", "reason"], registry=registry)
        self.escalated_feedback = Counter("calm_escalated_feedback_total", "Feedback on escalated answers (it judges the "
                                          "target)", ["domain", "correct"], registry=registry)
        self.reviews = Counter("calm_reviews_total", "Reviews opened and closed (open now: opened - closed)",
                               ["domain", "event"], registry=registry)
        self.review_webhook_errors = Counter("calm_review_webhook_errors_total", "Review webhooks that failed (the "
                                             "review stays in the database queue)", ["domain"], registry=registry)
        self.registry_syncs = Counter("calm_registry_syncs_total", "Registry polls completed (ok) or failed (error): a stalled "
                                      "count means promotions are not reaching this replica", ["outcome"], registry=registry)
        # The children the request path updates on every answer, looked up once per label set: prometheus_client's
        # `labels()` (a lock, a tuple, a dict) was a few percent of a request at the gateway's ceiling. Their label
        # values are bounded (endpoints x known domains x statuses).
        self.requests_of = lru_cache(maxsize=4096)(self.requests.labels)
        self.latency_of = lru_cache(maxsize=1024)(self.latency.labels)
        self.answer_children = lru_cache(maxsize=1024)(
            lambda domain: (self.answers.labels(domain), self.confidence.labels(domain), self.entropy.labels(domain)))


def reference_mean(ref: ReferenceHistogram) -> float:
    """The mean confidence a reference histogram describes (bin centres weighted by counts)."""
    centres = [(lo + hi) / 2 for lo, hi in zip(ref.bin_edges[:-1], ref.bin_edges[1:])]
    total = sum(ref.counts)
    return sum(c * n for c, n in zip(centres, ref.counts)) / total if total else float("nan")


class DomainMonitor:
    """Maps request domains to bounded labels and keeps each domain's live confidence window."""

    def __init__(self, metrics: Metrics, references: dict[str, ReferenceHistogram], extra_domains: list[str], window: int):
        self.metrics = metrics
        self.references = references
        self.known = known_domains(references, extra_domains)
        fallback = references.get("all") or (next(iter(references.values())) if references else None)
        self._windows: dict[str, ConfidenceWindow] = {}
        self._window_size = window
        self._lock = threading.Lock()
        for domain in sorted(self.known):
            ref = references.get(domain, fallback)
            if ref is not None:
                self._windows[domain] = ConfidenceWindow(ref.bin_edges, ref.counts, window)
                metrics.reference_confidence.labels(domain).set(reference_mean(ref))

    def label(self, domain: str | None) -> str:
        if not domain:
            return OTHER
        domain = domain.strip().lower()
        return domain if domain in self.known else OTHER

    def set_reference(self, domain: str, ref: ReferenceHistogram | None) -> None:
        """A new serving version for `domain`: its drift window starts afresh against that version's reference."""
        with self._lock:
            self.references = {**self.references, domain: ref} if ref is not None else {
                d: r for d, r in self.references.items() if d != domain}
            if ref is not None:
                self._windows[domain] = ConfidenceWindow(ref.bin_edges, ref.counts, self._window_size)
            else:
                self._windows.pop(domain, None)
        m = self.metrics
        for gauge in (m.drift_psi, m.drift_ks, m.window):
            gauge.labels(domain).set(0)
        m.reference_confidence.labels(domain).set(reference_mean(ref) if ref is not None else float("nan"))

    def reference(self, domain: str) -> tuple[list[float], list[int]] | None:
        ref = self.references.get(domain) or self.references.get("all")
        return (ref.bin_edges, ref.counts) if ref else None

    def observe_answer(self, domain: str, confidence: float, entropy: float, below: bool, abstained: bool,
                       drift: bool = True) -> None:
        m = self.metrics
        answers, confidences, entropies = m.answer_children(domain)
        answers.inc()
        confidences.observe(confidence)
        entropies.observe(entropy)
        if below:
            m.below_threshold.labels(domain).inc()
        if abstained:
            m.abstentions.labels(domain).inc()
        window = self._windows.get(domain) if drift else None
        if window is not None:
            with self._lock:
                reading = window.add(confidence)
            m.drift_psi.labels(domain).set(reading.psi)
            m.drift_ks.labels(domain).set(reading.ks)
            m.window.labels(domain).set(reading.window)
            m.est_accuracy.labels(domain).set(reading.mean_confidence)

    def observe_feedback(self, domain: str, correct: bool, confidences: list[float], outcomes: list[bool]) -> None:
        m = self.metrics
        m.feedback.labels(domain, str(bool(correct)).lower()).inc()
        acc, ece = online_accuracy_and_ece(confidences, outcomes)
        if not math.isnan(acc):
            m.online_accuracy.labels(domain).set(acc)
            m.online_ece.labels(domain).set(ece)
        m.feedback_count.labels(domain).set(len(confidences))
