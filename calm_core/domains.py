"""What a domain is, in one place (pure): the name a request may give (`metadata.domain`), the domains a gateway
serves, and the rule the admin API and the CLI both apply before storing anything for a domain (a policy, a key's
scope, labels, a job): a domain no request can reach would be stored and never apply, since requests naming it are
served and counted as `other`."""

from __future__ import annotations

import re
from collections.abc import Iterable

from calm_core.errors import CalmError

_BODY = r"[a-z0-9][a-z0-9_\-]{0,63}"
DOMAIN_NAME = rf"^{_BODY}$"  # requests' domains are lower-cased: another spelling never matches
DOMAIN_OR_GLOBAL = rf"^(\*|{_BODY})$"  # where the registry's global default `*` may be named too
OTHER = "other"  # where every domain a gateway does not serve is counted
_NAME = re.compile(DOMAIN_NAME)


class DomainError(CalmError):
    """A domain refused: not a domain name, or one no request can reach (requests naming it are counted as other)."""


def known_domains(references: Iterable[str], configured: Iterable[str]) -> set[str]:
    """The domains requests can name (any other is `other`): a serving artifact's reference domains and the
    configured ones (CALM_DOMAINS)."""
    return set(references) | set(configured) | {OTHER}


def checked_name(domain: str) -> str:
    if not _NAME.match(domain):
        raise DomainError(f"domain {domain!r}: a domain is lower-case letters, digits, '_' or '-' (at most 64)")
    return domain


def served_domain(domain: str, served: set[str], *, other: bool = True) -> str:
    """`domain` if requests can name it on a gateway serving `served` (known_domains), `other` only where allowed."""
    checked_name(domain)
    reachable = served - (set() if other else {OTHER})
    if domain not in reachable:
        raise DomainError(f"{domain!r} is not a domain this gateway serves: requests naming it are served and counted "
                          f"as {OTHER!r}. Served: {', '.join(sorted(reachable))}; name more in CALM_DOMAINS (on every "
                          "replica)")
    return domain
