"""What the `calm` commands share: one-line user errors, and the gateway's database, registry and domains as its
settings name them."""

from __future__ import annotations

import functools
import json
import os
import sys

import typer

from calm_core.domains import checked_name, known_domains
from calm_core.domains import served_domain as domain_rule
from calm_core.errors import CalmError


def one_line_errors(fn):
    """A user error (CalmError) is one line and exit status 2; a database the command cannot reach is one line and 1."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CalmError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except Exception as e:
            unreachable = _database_unreachable(e)
            if unreachable is None:
                raise
            typer.echo(f"error: cannot reach the gateway's database: {unreachable}", err=True)
            raise typer.Exit(1) from None

    return wrapper


def _database_unreachable(error: Exception) -> str | None:
    """The driver's first line when `error` is SQLAlchemy failing to connect (a server down, a wrong host or
    password), else None. SQLAlchemy is imported only once it raised."""
    if not type(error).__module__.startswith("sqlalchemy"):
        return None
    from sqlalchemy.exc import OperationalError

    if not isinstance(error, OperationalError):
        return None
    return str(error.orig or error).strip().splitlines()[0]


def gateway_settings(**given):
    """The gateway's settings from CALM_* (and `given`), a wrong value refused in one line naming its variable."""
    from pydantic import ValidationError

    from gateway.settings import GatewaySettings

    try:
        return GatewaySettings(**given)
    except ValidationError as e:
        error = e.errors()[0]
        where = f"CALM_{str(error['loc'][0]).upper()}: " if error.get("loc") else ""
        raise CalmError(f"invalid settings: {where}{error['msg']}") from None


def open_store(settings=None):
    from gateway.records.store import Store

    settings = settings or gateway_settings()
    warn_if_new_database(settings)
    return Store(settings.database)


def warn_if_new_database(settings) -> None:
    """The default database is relative to the folder the command runs in: `calm keys create` run from another folder
    once printed a key into a new database there, which the gateway (started elsewhere) never saw, then refused (401).
    A database about to be created where no setting named it is said on stderr before anything is stored."""
    if settings.db_url or "CALM_DB_PATH" in os.environ or settings.db_path.exists():
        return
    print(f"warning: no gateway database at {settings.db_path.resolve()}; creating a new one. A gateway started in "
          "another folder (`make serve` uses the checkout's .calm/gateway.sqlite3) will not see what this command "
          "stores: run it from that folder or set CALM_DB_PATH.", file=sys.stderr)


def open_registry(settings=None):
    from calm_core.registry import Registry

    settings = settings or gateway_settings()
    return Registry(open_store(settings), settings.registry_root, settings.registry_url)


def served_domain(domain: str, other: bool) -> str:
    """`domain` if requests can name it on a gateway with these settings, by the admin API's rule
    (calm_core/domains.py): its default version's reference domains, CALM_DOMAINS and `other` where allowed. Before
    any gateway has registered its default version only the spelling can be checked. Anything else is stored but never
    applies."""
    from calm_core.artifact import read_manifest
    from calm_core.registry import GLOBAL

    checked_name(domain)
    settings = gateway_settings()
    registry = open_registry(settings)
    default = registry.active().get(GLOBAL)
    if default is None:
        return domain
    references = read_manifest(registry.path_of(default)).get("reference_histograms") or {}
    return domain_rule(domain, known_domains(references, settings.domains), other=other)


def known_status(status: str | None, statuses: tuple[str, ...]) -> None:
    """A --status filter that names a status there is (a misspelt one would list nothing, as if there were none)."""
    if status is not None and status not in statuses:
        raise CalmError(f"--status {status!r}: a status is one of {', '.join(statuses)}")


def echo_json(data) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))
