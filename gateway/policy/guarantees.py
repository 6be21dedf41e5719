"""Guaranteed thresholds per domain: the Learn-then-Test fit of each domain's `guaranteed_risk` policy, kept current as
verdicts arrive.

Labels are the domain's feedback verdicts on its answers (confidence as served, correct or not). A fit is recomputed
when a domain first reaches its policy's `min_labels`, then every `refit_every` new verdicts (debounced: one fit per
batch of verdicts, not per request), and when a policy changes; each fit is stored and audited like a policy change.
Between fits the realised error rate of the answers let through is tracked on the verdicts received since.
"""

from __future__ import annotations

import threading
from dataclasses import asdict

from calm_core.risk_control import RiskFit, guaranteed_threshold, selective_risk, sequence_start
from gateway.observe.monitoring import Metrics
from gateway.policy.policies import Policy
from gateway.records.store import Store


class GuaranteedThresholds:
    def __init__(self, store: Store, metrics: Metrics, policy_of, reference_of, refit_every: int = 25):
        self.store = store
        self.metrics = metrics
        self.policy_of = policy_of  # domain -> (Policy | None, key, version): the policy in force there (PolicyBook)
        self.reference_of = reference_of  # domain -> reference histogram (edges, counts) | None
        self.refit_every = refit_every
        self._lock = threading.Lock()
        self._fits: dict[str, tuple[RiskFit, float]] = {
            d: (RiskFit(**fit), at) for d, (fit, at) in store.latest_risk_fits().items()}
        self._pending: dict[str, int] = {}
        for domain, (fit, at) in self._fits.items():
            self._export(domain, fit, at)

    def fit_for(self, domain: str) -> RiskFit | None:
        found = self._fits.get(domain)
        return found[0] if found else None

    def _guaranteed(self, domain: str) -> tuple[Policy, int | None] | None:
        """The domain's policy in force and its version, if it is a guaranteed risk."""
        policy, _, version = self.policy_of(domain)
        return (policy, version) if policy is not None and policy.kind == "guaranteed_risk" else None

    def on_feedback(self, domain: str) -> None:
        found = self._guaranteed(domain)
        if found is None:
            return
        policy, version = found
        with self._lock:
            self._pending[domain] = self._pending.get(domain, 0) + 1
            current = self.fit_for(domain)
            have = (current.n_labels if current else 0) + self._pending[domain]
            due = self._pending[domain] >= self.refit_every or (
                have >= policy.min_labels and (current is None or current.n_labels < policy.min_labels))
            if due:
                self._refit(domain, policy, version)
        self._export_current(domain)

    def refit_domain(self, domain: str) -> None:
        """Refit now (new labels arrived in bulk), if the domain's policy is a guaranteed risk."""
        found = self._guaranteed(domain)
        if found is not None:
            with self._lock:
                self._refit(domain, *found)
            self._export_current(domain)

    def on_policy_change(self) -> None:
        """Refit every labelled domain whose policy in force is a guaranteed risk (its target or δ may have changed)."""
        with self._lock:
            for domain in self.store.labelled_domains():
                found = self._guaranteed(domain)
                if found is not None:
                    self._refit(domain, *found)

    def _refit(self, domain: str, policy: Policy, version: int | None) -> None:
        confidence, correct = self.store.labelled_answers(domain)
        self._pending[domain] = 0
        if not confidence:
            return
        fit = guaranteed_threshold(confidence, correct, policy.target_risk, policy.delta,
                                   start=sequence_start(self.reference_of(domain)))
        previous = self.fit_for(domain)
        at = self.store.record_risk_fit(domain, asdict(fit), version or 0, asdict(previous) if previous else None)
        self._fits[domain] = (fit, at)

    def _export_current(self, domain: str) -> None:
        found = self._fits.get(domain)
        if found:
            self._export(domain, *found)

    def _export(self, domain: str, fit: RiskFit, at: float) -> None:
        m = self.metrics
        m.policy_threshold.labels(domain).set(fit.threshold if fit.threshold is not None else 1.0)
        m.policy_labels.labels(domain).set(fit.n_labels)
        confidence, correct = self.store.feedback_since(domain, at)
        kept = [(c, ok) for c, ok in zip(confidence, correct) if fit.threshold is not None and c >= fit.threshold]
        m.policy_realised_answers.labels(domain).set(len(kept))
        if kept:
            _, risk = selective_risk([c for c, _ in kept], [ok for _, ok in kept], fit.threshold)
            m.policy_realised_risk.labels(domain).set(risk)
