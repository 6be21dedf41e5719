"""`calm`, the command line: the root command and its groups, one module each, registered here and nowhere else
(as vLLM's entrypoints/cli/main.py registers its subcommands' modules).

A user error (CalmError) is one line on stderr and exit status 2, no traceback (common.one_line_errors). Commands
import the project modules that load a heavy package (torch, vLLM, PEFT, transformers, FastAPI, SciPy, SQLAlchemy,
aiohttp, numpy, httpx: tests/test_layout.py's HEAVY) inside their functions, where they run, so that `calm --help`
loads none of them; every other import is at the top of a file."""

from __future__ import annotations

import sys

import typer

from calm_cli import artifacts, evaluate, jobs, keys, reviews, serve, train
from calm_core.collector import collect_young_less_often

# Before a command runs: its heavy imports (inside the commands) are what calm_core/collector.py is for.
collect_young_less_often()

app = typer.Typer(help="CALM Gateway: calibrated LLM confidence.", no_args_is_help=True, add_completion=False)
for top_level in (evaluate.commands, train.commands, serve.commands):  # eval; train, report; serve, engine, worker
    app.add_typer(top_level)
app.add_typer(train.model_app, name="model")
app.add_typer(artifacts.app, name="artifacts")
app.add_typer(artifacts.app, name="artifact", hidden=True)  # the old name of the folder commands: scripts keep working
app.add_typer(train.split_app, name="split")
app.add_typer(evaluate.policy_app, name="policy")
app.add_typer(keys.app, name="keys")
app.add_typer(jobs.app, name="jobs")
app.add_typer(reviews.app, name="reviews")


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
