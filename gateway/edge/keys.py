"""Client API keys for /v1/*: created and revoked by the admin (API or `calm keys`), stored hashed, optionally limited
to some domains and to a request rate.

A key is `calm-<id>-<secret>`: the id (8 random bytes, hex) names it in lists and logs, the secret (32 random bytes,
URL-safe) is shown once and never stored; the store keeps sha256(key). Keys are random, so a plain hash is enough (no
password stretching), and a key is found by looking its digest up (what a timing difference could reveal is a digest,
not a key), never by its id: keys issued with 4-byte ids keep working.

Rate limits are a token bucket per key and per gateway replica (`requests_per_minute`, burst of the same size):
an empty bucket answers 429 with Retry-After, the seconds until the next token. Revocations reach every replica
within REFRESH_S (keys are re-read from the shared store).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

from sqlalchemy.exc import IntegrityError

from gateway.records.cached import CachedRead
from gateway.records.client_keys import ClientKey
from gateway.errors import APIError
from gateway.protocol.admin import KeyCreated

PREFIX = "calm"
REFRESH_S = 5.0
ID_BYTES = 8  # 4 made a repeated id a 1 % chance by some 9,300 keys (even by 77,000), and its creation a 500
ISSUE_TRIES = 3


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """(id, key): the key to hand out once, and its id."""
    key_id = secrets.token_hex(ID_BYTES)
    return key_id, f"{PREFIX}-{key_id}-{secrets.token_urlsafe(32)}"


class TokenBucket:
    def __init__(self, per_minute: float, now: float):
        self.rate = per_minute / 60.0
        self.capacity = max(per_minute, 1.0)
        self.tokens = self.capacity
        self.at = now

    def take(self, now: float) -> float:
        """0 when a request may pass (one token taken), else the seconds until the next token."""
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class KeyRing(CachedRead[dict]):
    """The client keys in force: read from the store, cached for REFRESH_S, refreshed at once on this replica's writes."""

    def __init__(self, store, required: bool, clock=time.monotonic):
        super().__init__(store.active_client_keys, REFRESH_S, clock)
        self.store = store
        self.required = required
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def authenticate(self, authorization: str | None) -> ClientKey | None:
        """The caller's key; None when keys are not required and none was sent. 401 without a usable key."""
        if not authorization:
            if self.required:
                raise APIError(401, "an API key is required: send 'Authorization: Bearer <key>'", "authentication_error",
                               code="missing_api_key")
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "send the API key as 'Authorization: Bearer <key>'", "authentication_error",
                           code="invalid_api_key")
        found = self.get().get(hash_key(key.strip()))
        if found is None:
            if not self.required and not key.startswith(f"{PREFIX}-"):
                return None  # development: the OpenAI client's placeholder keys ("unused", "sk-...") still pass
            raise APIError(401, "the API key is not valid (unknown or revoked)", "authentication_error",
                           code="invalid_api_key")
        return found

    def admit(self, key: ClientKey | None, domain: str) -> None:
        """403 for a domain the key may not use; 429 with Retry-After when its rate is spent."""
        if key is None:
            return
        if not key.allows(domain):
            raise APIError(403, f"this API key may not use domain {domain!r}", "permission_error", param="domain")
        if key.requests_per_minute is None:
            return
        with self._lock:
            now = self.clock()
            bucket = self._buckets.get(key.id)
            if bucket is None or bucket.rate != key.requests_per_minute / 60.0:
                bucket = self._buckets[key.id] = TokenBucket(key.requests_per_minute, now)
            wait = bucket.take(now)
        if wait > 0:
            raise APIError(429, f"rate limit of {key.requests_per_minute:g} requests per minute reached for key "
                           f"{key.id}", "rate_limit_error", code="rate_limit_exceeded",
                           retry_after_s=max(1, int(wait + 0.999)))


def issue_key(store, name: str, domains: list[str] | None, requests_per_minute: float | None, labeller: bool = False,
              sequences_per_minute: int | None = None):
    """Create a key: its hash goes to the store, the key itself only to the caller (once). An id (or digest) already
    stored is drawn again: the insert fails as a whole, so nothing of the first draw is kept."""
    for attempt in range(ISSUE_TRIES):
        key_id, key = new_key()
        try:
            at = store.add_client_key(key_id, name, hash_key(key), domains, requests_per_minute, labeller,
                                      sequences_per_minute)
            break
        except IntegrityError:
            if attempt == ISSUE_TRIES - 1:
                raise
    return KeyCreated(id=key_id, name=name, domains=domains, requests_per_minute=requests_per_minute, created_at=at,
                      labeller=labeller, sequences_per_minute=sequences_per_minute, key=key)
