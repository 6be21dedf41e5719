"""A client key as stored: its id, name, domains and limits (the key itself is never stored, only its hash:
gateway/edge/keys.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClientKey:
    id: str
    name: str
    domains: tuple[str, ...] | None  # None: every domain
    requests_per_minute: float | None  # None: unlimited
    created_at: float
    revoked_at: float | None = None
    labeller: bool = False  # may give feedback on answers other keys received (in its domains)
    sequences_per_minute: int | None = None  # engine work per minute over every replica (gateway/edge/usage.py)

    def allows(self, domain: str) -> bool:
        return self.domains is None or domain in self.domains
