"""The hop from one CALM gateway to another (an escalate policy whose target speaks protocol "calm"): the receiving
gateway answers such a request without handing it off again, so two gateways pointing at each other cannot bounce it.

Any caller can send a header, so the hop must prove where it comes from: `X-Calm-Escalated: <unix time>.<HMAC>` of
that time and the exact request body, under the secret the operator gives every gateway of the fleet
(`CALM_PEER_SECRET`). A value that is missing, malformed, stale (over `MAX_SKEW_S` apart from this gateway's clock),
for another body or made without the secret is no hop: the request is answered as any caller's, policy and review
included. A gateway with no secret sends no hop and accepts none. The secret never travels; a captured header only
replays the same request within the window, which buys nothing a caller could not get from sending it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time

HOP_HEADER = "X-Calm-Escalated"
MAX_SKEW_S = 300


def hop_value(secret: str, body: bytes, now: float | None = None) -> str:
    stamp = str(int(time.time() if now is None else now))
    return f"{stamp}.{_mac(secret, stamp, body)}"


_SHAPE = re.compile(r"([0-9]{1,12})\.([0-9a-f]{64})")  # ASCII digits only: str.isdigit() takes '²', which int() refuses


def is_peer_hop(secret: str | None, value: str | None, body: bytes, now: float | None = None) -> bool:
    shape = _SHAPE.fullmatch(value) if secret and value else None
    if shape is None or abs((time.time() if now is None else now) - int(shape[1])) > MAX_SKEW_S:
        return False
    return hmac.compare_digest(shape[2], _mac(secret, shape[1], body))


def _mac(secret: str, stamp: str, body: bytes) -> str:
    return hmac.new(secret.encode(), stamp.encode() + b"." + body, hashlib.sha256).hexdigest()
