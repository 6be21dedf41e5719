"""What the routers share: the app's state, admin and client authentication, the documented error statuses, and the
domain rules (a valid name; one this gateway tells apart)."""

from __future__ import annotations

import hmac
from http import HTTPStatus
from typing import Annotated

from fastapi import Header, Request
from fastapi import Path as FastAPIPath

from calm_core.domains import DOMAIN_NAME, DomainError, checked_name
from calm_core.domains import served_domain as domain_rule
from gateway.errors import APIError
from gateway.records.client_keys import ClientKey
from gateway.policy.policies import DEFAULT_DOMAIN
from gateway.protocol.common import ErrorResponse
from gateway.state import GatewayState

DOMAIN_PATTERN = DOMAIN_NAME
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
    if domain != DEFAULT_DOMAIN:
        try:
            checked_name(domain)
        except DomainError:
            raise APIError(400, "domain must be lower-case letters, digits, '_' or '-', at most 64 characters",
                           param="domain") from None
    return domain


def served_domain(gateway: GatewayState, domain: str, *, default: bool = False, other: bool = True) -> str:
    """`domain` if requests can name it (calm_core/domains.py, the rule the CLI applies too), or `default` where
    allowed; a 404 otherwise: requests naming it are served and counted as `other`, so a policy, a key or labels stored
    for it would never apply."""
    checked_domain(domain)
    if domain == DEFAULT_DOMAIN and default:
        return domain
    try:
        return domain_rule(domain, gateway.monitor.known, other=other)
    except DomainError as e:
        raise APIError(404, str(e), "not_found_error", "domain", code="domain_not_found") from None
