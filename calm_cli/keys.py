"""`calm keys`: the client API keys of /v1/*, in the gateway's database; running gateways follow within seconds."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from calm_cli.common import one_line_errors, open_store, served_domain
from calm_core.errors import CalmError

app = typer.Typer(help="Client API keys for /v1/* (in the gateway's database, CALM_DB_PATH).", no_args_is_help=True)


@app.command("create")
@one_line_errors
def keys_create(
    name: Annotated[str, typer.Option(help="who or what the key is for")],
    domain: Annotated[Optional[list[str]], typer.Option("--domain", help="allowed domain (repeatable); all if none")] = None,
    rate: Annotated[Optional[float], typer.Option(help="requests per minute (token bucket); unlimited if unset")] = None,
    labeller: Annotated[bool, typer.Option(help="may give feedback on answers other keys received")] = False,
    sequences: Annotated[Optional[int], typer.Option(
        "--sequences-per-minute", help="engine sequences per minute over every replica; unlimited if unset")] = None,
):
    """Create a key and print it once (only its hash is stored). Running gateways see it within seconds."""
    from gateway.edge.keys import issue_key

    if rate is not None and rate <= 0:
        raise typer.BadParameter("--rate must be positive")
    if sequences is not None and sequences <= 0:
        raise typer.BadParameter("--sequences-per-minute must be positive")
    for name_ in domain or []:
        served_domain(name_, other=True)
    created = issue_key(open_store(), name, list(domain) if domain else None, rate, labeller, sequences)
    typer.echo(f"{created.key}\n(id {created.id}; shown once, store it now)")


@app.command("list")
@one_line_errors
def keys_list():
    """Every key: id, name, domains, rate, and whether it is revoked (never the key itself)."""
    for key, _ in open_store().client_keys():
        state = "revoked" if key.revoked_at else "active"
        domains = ",".join(key.domains) if key.domains else "*"
        rate = f"{key.requests_per_minute:g}/min" if key.requests_per_minute else "unlimited"
        typer.echo(f"{key.id}  {state:7s}  {key.name}  domains={domains}  rate={rate}" + ("  labeller" if key.labeller else ""))


@app.command("revoke")
@one_line_errors
def keys_revoke(key_id: str):
    """Revoke a key by id; gateways refuse it within seconds."""
    if not open_store().revoke_client_key(key_id):
        raise CalmError(f"no active API key with id {key_id!r}")
    typer.echo(f"revoked {key_id}")
