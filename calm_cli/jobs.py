"""`calm jobs`: the retraining jobs in the gateway's database, queued by drift alerts or operators and run by
`calm worker`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from calm_cli.common import echo_json, known_status, one_line_errors, open_store, served_domain
from calm_core.errors import CalmError

app = typer.Typer(help="Retraining jobs (queued by drift alerts or operators, run by `calm worker`).",
                  no_args_is_help=True)


@app.command("list")
@one_line_errors
def jobs_list(domain: Annotated[Optional[str], typer.Option()] = None,
              status: Annotated[Optional[str], typer.Option()] = None):
    """Jobs, newest first: status, progress, trigger, candidate."""
    from calm_core.jobs import FINISHED, JobQueue, OPEN

    known_status(status, OPEN + FINISHED)
    for j in JobQueue(open_store()).list(domain, status):
        typer.echo(f"{j.id}  {j.status:17s}  {j.progress:4.0%}  domain={j.domain}  trigger={j.trigger}  "
                   f"attempts={j.attempts}  candidate={j.candidate or '-'}")


@app.command("show")
@one_line_errors
def jobs_show(job_id: str):
    """One job with its log and result (the gate's decision and the numbers behind it)."""
    from calm_core.jobs import JobQueue

    job = JobQueue(open_store()).get(job_id)
    if job is None:
        raise CalmError(f"no job {job_id!r}")
    echo_json(job.as_dict())


@app.command("create")
@one_line_errors
def jobs_create(domain: str, method: Annotated[Optional[str], typer.Option(
        help="auto | label_free | labelled (default: the loop config's, auto: labelled where the domain has enough labels)")] = None):
    """Queue a retraining job for a domain by hand (the open one is reused if there is one)."""
    from calm_core.jobs import JobQueue

    if method is not None:  # checked only where named: the names' module loads torch (the worker's modules)
        from training.retrain.labelled import METHODS

        if method not in METHODS:
            raise typer.BadParameter(f"one of {', '.join(METHODS)}", param_hint="--method")
    served_domain(domain, other=False)
    job, created = JobQueue(open_store()).enqueue(domain, "operator", {"by": "cli", **({"method": method} if method else {})})
    typer.echo(f"{job.id} {'queued' if created else 'already open'} for {domain}")
