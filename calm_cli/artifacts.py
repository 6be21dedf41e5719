"""`calm artifacts`: alpha-head artifacts, as folders (written by the commands of artifact_folders.py, shown) and as
the registry's versions in the gateway's database (add, list, show, promote, roll back; running gateways follow within
their registry poll). One group: `calm artifact`, the folders' group before the two were merged, is its hidden alias."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from calm_cli import artifact_folders
from calm_cli.common import echo_json, known_status, one_line_errors, open_registry, served_domain
from calm_core.errors import CalmError

app = typer.Typer(help="Alpha-head artifacts: write one (identity, attach-free-form, fit-semantic, recalibrate), show "
                  "one, and the registry's versions: add one made outside the loop, which serves which domain, "
                  "promotion and rollback (the gateway's database; running gateways switch within seconds). "
                  "`calm artifact` is its old name.", no_args_is_help=True)
for name, command in (("identity", artifact_folders.identity), ("attach-free-form", artifact_folders.attach_free_form),
                      ("fit-semantic", artifact_folders.fit_semantic), ("recalibrate", artifact_folders.recalibrate)):
    app.command(name)(command)


@app.command("show")
@one_line_errors
def show(target: Annotated[str, typer.Argument(help="an artifact folder, or a version in the registry")]):
    """An artifact folder: verified, its manifest printed. A registry version: lineage, metrics (the gate's inputs and
    decision for retrained ones), folder."""
    from calm_core.artifact import load_artifact

    # A version's name has no path separator: anything that has one, or names something on disk, is a folder (a
    # mistyped folder is reported as one, without opening, or creating, the gateway's database).
    if Path(target).exists() or "/" in target or target.startswith(("~", ".")):
        typer.echo(load_artifact(Path(target).expanduser()).manifest.model_dump_json(indent=2))
        return
    record = open_registry().get(target)
    if record is None:
        raise CalmError(f"{target!r} is neither an artifact folder nor a version in the registry")
    echo_json(record.as_dict())


@app.command("list")
@one_line_errors
def artifacts_list(domain: Annotated[Optional[str], typer.Option(help="versions trained for this domain")] = None,
                   status: Annotated[Optional[str], typer.Option(help="candidate | active | rejected | retired")] = None):
    """Every version, newest first: status, the domains it serves, its domain, parent and trigger."""
    from calm_core.registry import STATUSES

    known_status(status, STATUSES)
    registry = open_registry()
    for r in registry.list(domain, status):
        serves = ",".join(r.active_for) or "-"
        typer.echo(f"{r.version}  {r.status:9s}  serves={serves}  domain={r.domain or '*'}  parent={r.parent or '-'}  "
                   f"trigger={r.trigger}" + (f"  reason={r.reason}" if r.reason else ""))
    typer.echo("active: " + ", ".join(f"{d}={v}" for d, v in sorted(registry.active().items())))


def _same_base(manifest, default_dir: Path) -> None:
    """Refuse a version for other weights or another tokenizer than the default the gateways serve: its adapter and
    head would be applied to a model they were not trained on."""
    from calm_core.artifact import read_manifest

    default = read_manifest(default_dir)
    base, tokenizer = default["base_model"], default["tokenizer"]
    if (manifest.base_model.weights_sha256, manifest.tokenizer.sha256) != (base["weights_sha256"], tokenizer["sha256"]):
        raise CalmError(f"{manifest.artifact_version} was trained on {manifest.base_model.id} "
                        f"({manifest.base_model.weights_sha256[:16]}…); the gateways serve {base['id']} "
                        f"({base['weights_sha256'][:16]}…)")


@app.command("add")
@one_line_errors
def artifacts_add(
    folder: Annotated[Path, typer.Argument(help="an artifact folder (`calm train`, `calm artifacts recalibrate`)")],
    domain: Annotated[Optional[str], typer.Option(
        help="the domain it is for (default: the one it was recalibrated for; none: any)")] = None,
    promote: Annotated[bool, typer.Option(help="make it serve its domain (or the default, without one) at once")] = False,
):
    """Register an artifact made outside the loop as a candidate version: verified, copied into the registry, its
    lineage recorded (a recalibrated version's parent and held-out check); promote it here or with `promote`."""
    from calm_core.artifact import load_artifact
    from calm_core.registry import GLOBAL

    manifest = load_artifact(folder).manifest
    lineage = manifest.recalibration
    domain = None if domain == GLOBAL else domain or (lineage.domain if lineage else None)
    if domain is not None:
        served_domain(domain, other=False)
    registry = open_registry()
    default = registry.active().get(GLOBAL)
    if default is not None:
        _same_base(manifest, registry.path_of(default))
    known = registry.get(manifest.artifact_version) is not None
    record = registry.add(folder, trigger="import", domain=domain, parent=lineage.parent if lineage else None,
                          metrics={"recalibration": lineage.held_out} if lineage else None)
    typer.echo(f"{record.version}: {'already registered' if known else 'registered'} ({record.status}, "
               f"domain={record.domain or '*'}, parent={record.parent or '-'})")
    if promote:  # a refusal is a RegistryError, a CalmError: one line
        previous = registry.promote(record.version, record.domain or GLOBAL, actor="cli")
        typer.echo(f"{record.domain or '*'}: {record.version} (was {previous or 'the default'})")
    elif record.status == "candidate":
        typer.echo(f"serve it: calm artifacts promote {record.version} --domain {record.domain or '*'}")


@app.command("promote")
@one_line_errors
def artifacts_promote(version: str, domain: Annotated[str, typer.Option(help="the domain it serves; * = the default")] = "*"):
    """Make a version serve a domain (a candidate left for the operator, or any earlier one)."""
    if domain != "*":
        served_domain(domain, other=False)
    previous = open_registry().promote(version, domain, actor="cli")  # RegistryError is a CalmError: one line
    typer.echo(f"{domain}: {version} (was {previous or 'the default'})")


@app.command("rollback")
@one_line_errors
def artifacts_rollback(domain: Annotated[str, typer.Option(help="the domain to roll back; * = the default")] = "*"):
    """Return a domain to the version it had before (a domain's own version rolls back to the default)."""
    version = open_registry().rollback(domain, actor="cli")  # RegistryError is a CalmError: one line
    typer.echo(f"{domain}: {version or 'the default'}")
