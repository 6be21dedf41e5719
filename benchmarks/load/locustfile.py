"""Locust users for the gateway's load suite (benchmarks/load/load_suite.py runs it): what an application sends — multiple
choice with options, short free-form answers, feedback on its own answers — plus an operator changing a policy now and
then. A 429 (server busy, rate limit) is an expected answer under load and counted as a success; anything else that
is not a 200 is a failure.

Every acknowledged write is counted into a file at the end (LOAD_COUNTS), so the suite can check the database holds
exactly that many.
"""

from __future__ import annotations

import json
import os
import random
import threading

from locust import HttpUser, between, events, task

MODEL = os.environ.get("LOAD_MODEL", "calm-smollm2-135m")
ADMIN = {"Authorization": f"Bearer {os.environ.get('LOAD_ADMIN_KEY', 'dev-admin-key')}"}
QUESTIONS = json.loads(open(os.environ["LOAD_QUESTIONS"]).read())
COUNTS = {"feedback": 0, "policy_puts": 0}
_LOCK = threading.Lock()


def _count(name: str) -> None:
    with _LOCK:
        COUNTS[name] += 1


@events.quitting.add_listener
def _write_counts(environment, **_):
    with open(os.environ["LOAD_COUNTS"], "w") as f:
        json.dump(COUNTS, f)


class Application(HttpUser):
    wait_time = between(0.5, 2.0)

    def on_start(self):
        self.answered: list[str] = []

    def on_stop(self):
        # An application judges what it was answered even when the run ends first: on a slow machine the feedback task
        # may never come round within --run-time, and the count-back check would then hold vacuously.
        if self.answered:
            self.feedback()

    def _post(self, path: str, body: dict, name: str, headers: dict | None = None):
        with self.client.post(path, json=body, name=name, headers=headers, catch_response=True) as r:
            if r.status_code in (200, 429):
                r.success()
            else:
                # Status 0: no answer at all; requests' exception says why (a reset, a refused connection).
                r.failure(f"{r.status_code}: {r.text[:200] if r.status_code else repr(r.error)}")
            return r

    @task(5)
    def multiple_choice(self):
        q = random.choice(QUESTIONS)
        r = self._post("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": q["question"]}], "options": q["choices"],
            "metadata": {"domain": q["domain"]}}, "chat (multiple choice)")
        if r.status_code == 200:
            self.answered.append(r.json()["id"])

    @task(3)
    def free_form(self):
        q = random.choice(QUESTIONS)
        self._post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": q["question"]}],
            "metadata": {"domain": q["domain"]}}, "chat (free form)")

    @task(2)
    def feedback(self):
        if not self.answered:
            return
        response_id = self.answered.pop()
        r = self._post("/v1/feedback", {"response_id": response_id, "correct": random.random() < 0.5}, "feedback")
        if r.status_code == 200 and r.json()["recorded"]:
            _count("feedback")

    @task(1)
    def policy(self):
        if random.random() < 0.9:  # the operator is rarer than the applications
            return
        with self.client.put("/admin/policies/load", json={"threshold": round(random.uniform(0, 0.3), 2)},
                             headers=ADMIN, name="policy put", catch_response=True) as r:
            if r.status_code == 200:
                _count("policy_puts")
                r.success()
            else:
                r.failure(f"{r.status_code}: {r.text[:200]}")
