"""`calm artifacts` and `calm jobs`: the artifact registry (register, promote, roll back) and the retraining jobs, in
the gateway's database; running gateways follow within their registry poll."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from calm_cli.common import echo_json, one_line_errors, open_registry, open_store, served_domain
from calm_core.errors import CalmError

artifacts_app = typer.Typer(help="The artifact registry: versions (add one made outside the loop), which serves which "
                            "domain, promotion and rollback (the gateway's database; running gateways switch within "
                            "seconds).", no_args_is_help=True)
jobs_app = typer.Typer(help="Retraining jobs (queued by drift alerts or operators, run by `calm worker`).",
                       no_args_is_help=True)


def _known(status: str | None, statuses: tuple[str, ...]) -> None:
    """A --status filter that names a status there is (a misspelt one would list nothing, as if there were none)."""
    if status is not None and status not in statuses:
        raise CalmError(f"--status {status!r}: a status is one of {', '.join(statuses)}")


@artifacts_app.command("list")
@one_line_errors
def artifacts_list(domain: Annotated[Optional[str], typer.Option(help="versions trained for this domain")] = None,
                   status: Annotated[Optional[str], typer.Option(help="candidate | active | rejected | retired")] = None):
    """Every version, newest first: status, the domains it serves, its domain, parent and trigger."""
    from calm_core.registry import STATUSES

    _known(status, STATUSES)
    registry = open_registry()
    for r in registry.list(domain, status):
        serves = ",".join(r.active_for) or "-"
        typer.echo(f"{r.version}  {r.status:9s}  serves={serves}  domain={r.domain or '*'}  parent={r.parent or '-'}  "
                   f"trigger={r.trigger}" + (f"  reason={r.reason}" if r.reason else ""))
    typer.echo("active: " + ", ".join(f"{d}={v}" for d, v in sorted(registry.active().items())))


@artifacts_app.command("show")
@one_line_errors
def artifacts_show(version: str):
    """One version: lineage, metrics (the gate's inputs and decision for retrained ones), folder."""
    record = open_registry().get(version)
    if record is None:
        raise CalmError(f"no artifact version {version!r} in the registry")
    echo_json(record.as_dict())


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


@artifacts_app.command("add")
@one_line_errors
def artifacts_add(
    folder: Annotated[Path, typer.Argument(help="an artifact folder (`calm train`, `calm artifact recalibrate`)")],
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


@artifacts_app.command("promote")
@one_line_errors
def artifacts_promote(version: str, domain: Annotated[str, typer.Option(help="the domain it serves; * = the default")] = "*"):
    """Make a version serve a domain (a candidate left for the operator, or any earlier one)."""
    if domain != "*":
        served_domain(domain, other=False)
    previous = open_registry().promote(version, domain, actor="cli")  # RegistryError is a CalmError: one line
    typer.echo(f"{domain}: {version} (was {previous or 'the default'})")


@artifacts_app.command("rollback")
@one_line_errors
def artifacts_rollback(domain: Annotated[str, typer.Option(help="the domain to roll back; * = the default")] = "*"):
    """Return a domain to the version it had before (a domain's own version rolls back to the default)."""
    version = open_registry().rollback(domain, actor="cli")  # RegistryError is a CalmError: one line
    typer.echo(f"{domain}: {version or 'the default'}")


@jobs_app.command("list")
@one_line_errors
def jobs_list(domain: Annotated[Optional[str], typer.Option()] = None,
              status: Annotated[Optional[str], typer.Option()] = None):
    """Jobs, newest first: status, progress, trigger, candidate."""
    from calm_core.jobs import FINISHED, OPEN, JobQueue

    _known(status, OPEN + FINISHED)
    for j in JobQueue(open_store()).list(domain, status):
        typer.echo(f"{j.id}  {j.status:17s}  {j.progress:4.0%}  domain={j.domain}  trigger={j.trigger}  "
                   f"attempts={j.attempts}  candidate={j.candidate or '-'}")


@jobs_app.command("show")
@one_line_errors
def jobs_show(job_id: str):
    """One job with its log and result (the gate's decision and the numbers behind it)."""
    from calm_core.jobs import JobQueue

    job = JobQueue(open_store()).get(job_id)
    if job is None:
        raise CalmError(f"no job {job_id!r}")
    echo_json(job.as_dict())


@jobs_app.command("create")
@one_line_errors
def jobs_create(domain: str, method: Annotated[Optional[str], typer.Option(
        help="auto | label_free | labelled (default: the loop config's, auto: labelled where the domain has enough labels)")] = None):
    """Queue a retraining job for a domain by hand (the open one is reused if there is one)."""
    from calm_core.jobs import JobQueue
    from training.retrain.labelled import METHODS

    if method is not None and method not in METHODS:
        raise typer.BadParameter(f"one of {', '.join(METHODS)}", param_hint="--method")
    served_domain(domain, other=False)
    job, created = JobQueue(open_store()).enqueue(domain, "operator", {"by": "cli", **({"method": method} if method else {})})
    typer.echo(f"{job.id} {'queued' if created else 'already open'} for {domain}")
