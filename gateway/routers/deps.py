"""What the routers share: the app's state, admin and client authentication, the documented error statuses, and the
domain rules (a valid name; one this gateway tells apart)."""

from __future__ import annotations

import hmac
import re
from http import HTTPStatus
from typing import Annotated

from fastapi import Header, Request
from fastapi import Path as FastAPIPath

from gateway.errors import APIError
from gateway.keys import ClientKey
from gateway.monitoring import OTHER
from gateway.policies import DEFAULT_DOMAIN
from gateway.protocol.common import DOMAIN_NAME, ErrorResponse
from gateway.state import GatewayState

DOMAIN_PATTERN = DOMAIN_NAME
_DOMAIN_NAME = re.compile(DOMAIN_PATTERN)
# A domain in a path: the rule is in the OpenAPI schema, so a schema-valid name is never refused.
DomainPath = Annotated[str, FastAPIPath(pattern=DOMAIN_PATTERN, description="lower-case letters, digits, '_' or '-'")]


def documented(*statuses: int) -> dict:
    """OpenAPI entries for the error statuses a route answers, all in the OpenAI error shape."""
    return {status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase} for status in statuses}


# Dependencies are coroutines: FastAPI runs a plain function in a worker thread, a hop per request.
async def state(request: Request) -> GatewayState:
    return request.app.state.gateway


def holds_admin_key(request: Request, authorization: str | None) -> bool:
    scheme, _, key = (authorization or "").partition(" ")
    expected = request.app.state.gateway.settings.admin_key
    return scheme.lower() == "bearer" and hmac.compare_digest(key.encode(), expected.encode())


async def admin(request: Request, authorization: str | None = Header(default=None)) -> str:
    if not authorization:
        raise APIError(401, "admin key required: send 'Authorization: Bearer <key>'", "authentication_error")
    if not holds_admin_key(request, authorization):
        raise APIError(403, "admin key is not valid", "permission_error")
    return "admin"


async def client(request: Request, authorization: str | None = Header(default=None)) -> ClientKey | None:
    return request.app.state.gateway.keyring.authenticate(authorization)


def checked_domain(domain: str) -> str:
    if domain != DEFAULT_DOMAIN and not _DOMAIN_NAME.match(domain):
        raise APIError(400, "domain must be lower-case letters, digits, '_' or '-', at most 64 characters", param="domain")
    return domain


def served_domain(gateway: GatewayState, domain: str, *, default: bool = False, other: bool = True) -> str:
    """`domain` if requests can name it: the artifact's reference domains, CALM_DOMAINS and `other` (unless refused), or
    `default` where allowed. Anything else is a 404: requests naming it are served and counted as `other`, so a policy,
    a key or labels stored for it would never apply."""
    checked_domain(domain)
    if (domain == DEFAULT_DOMAIN and default) or (domain in gateway.monitor.known and (other or domain != OTHER)):
        return domain
    served = sorted(gateway.monitor.known - ({OTHER} if not other else set()))
    raise APIError(404, f"{domain!r} is not a domain this gateway serves: requests naming it are served and counted as "
                   f"{OTHER!r}. Served: {', '.join(served)}; name more in CALM_DOMAINS (on every replica)",
                   "not_found_error", "domain", code="domain_not_found")
