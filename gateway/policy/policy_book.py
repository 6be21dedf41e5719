"""The abstention policies in force, cached from the store (read on every request)."""

from __future__ import annotations

import time

from gateway.records.cached import CachedRead
from gateway.policy.policies import DEFAULT_DOMAIN, Policy, stored_policy
from gateway.records.store import Store


class PolicyBook(CachedRead[dict]):
    """Policies cached from the store: refreshed at once on this replica's admin writes, and re-read when older than
    `max_age_s`, so a change made through another replica sharing the database is in force here within that time."""

    def __init__(self, store: Store, max_age_s: float = 5.0, clock=time.monotonic):
        super().__init__(lambda: {d: (stored_policy(body), v) for d, (body, v) in store.list_policies().items()},
                         max_age_s, clock)
        self.refresh()

    def for_domain(self, domain: str) -> tuple[Policy | None, str]:
        policy, key, version = self.in_force(domain)
        return (policy, f"{key}:v{version}") if policy is not None else (None, "builtin")

    def in_force(self, domain: str) -> tuple[Policy | None, str | None, int | None]:
        """The policy that applies to a domain (its own, else the default), with its key and version."""
        policies = self.get()
        for key in (domain, DEFAULT_DOMAIN):
            if key in policies:
                policy, version = policies[key]
                return policy, key, version
        return None, None, None
