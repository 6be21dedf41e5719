"""`calm reviews`: the queue review policies fill with the answers they withheld, in the gateway's database."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Annotated, Optional

import typer

from calm_cli.common import one_line_errors, open_store
from calm_core.errors import CalmError

app = typer.Typer(help="The review queue of review policies (in the gateway's database, CALM_DB_PATH).",
                  no_args_is_help=True)


@app.command("list")
@one_line_errors
def reviews_list(
    status: Annotated[str, typer.Option(help="open, closed or all")] = "open",
    domain: Annotated[Optional[str], typer.Option(help="only this domain")] = None,
    limit: Annotated[int, typer.Option(help="at most this many, oldest first")] = 100,
):
    """Reviews, oldest first, one JSON line each: id, domain, when it was queued and how long it waited (so far, if
    open), the withheld answer (a multiple-choice letter with its option's text) and its confidence, the request, and
    the verdict once closed. Close one with POST /admin/reviews/{id} on a gateway."""
    from gateway.records.handoff_store import HandoffStore

    if status not in ("open", "closed", "all"):
        raise CalmError("--status must be open, closed or all")
    for review in HandoffStore(open_store()).reviews(status, domain, limit):
        queued = datetime.fromtimestamp(review.created_at, timezone.utc).isoformat(timespec="seconds")
        typer.echo(json.dumps({"id": review.id, "domain": review.domain, "created_at": queued,
                               "waited_s": round((review.closed_at or time.time()) - review.created_at),
                               "answer": review.answer,
                               "answer_option": review.answer_option,
                               "confidence": round(review.confidence, 4), "request": review.request,
                               "correct": review.correct, "note": review.note}))
