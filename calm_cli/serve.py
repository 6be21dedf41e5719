"""The long-running processes: `calm serve` (the gateway), `calm engine` (a vLLM server for gateways with
CALM_ENGINE=upstream) and `calm worker` (the retraining loop's jobs). What they run is composed in serving.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from adapters.hosting.engine_server_fork import EngineServerFork
from calm_cli.common import gateway_settings, one_line_errors
from calm_core.errors import CalmError
from calm_core.startup import StartupLog, stage

commands = typer.Typer()


@commands.command("serve")
@one_line_errors
def serve(
    host: Annotated[Optional[str], typer.Option(help="default: CALM_HOST or 127.0.0.1")] = None,
    port: Annotated[Optional[int], typer.Option(help="default: CALM_PORT or 8000")] = None,
    artifact: Annotated[Optional[Path], typer.Option(help="alpha-head artifact; default: the model's shipped one")] = None,
):
    """Run the gateway: OpenAI-compatible API with calibrated confidence (settings from CALM_* variables)."""
    import uvicorn

    from calm_cli.serving import build_gateway
    from gateway.edge.http_server import server_config
    from gateway.settings import EngineKind
    from gateway.edge.starting import StartingApp

    progress = StartupLog().install()
    given = {"host": host, "port": port, "artifact": str(artifact) if artifact else None}
    settings = gateway_settings(**{k: v for k, v in given.items() if v is not None})
    url = f"http://{settings.host}:{settings.port}"
    typer.echo(f"CALM Gateway on {url}  (model {settings.served_model_name}, engine {settings.engine.value}); "
               "/health/live answers now, /health/ready and /v1/* once the engines have started")
    # The server listens at once; the app (model conversion on a first run, merged weights) and its engines are built
    # behind it (gateway/edge/starting.py), which answers 503 "starting" meanwhile.
    # In-process CPU engines: their server is forked from this process once it has imported vLLM (engine_server_fork.py).
    before = EngineServerFork.planned(settings.engine_overrides()) if settings.engine is EngineKind.INPROCESS else None
    starting = StartingApp(lambda: build_gateway(settings), doing=lambda: f"{progress.current} ({progress.elapsed():.0f} s)",
                           before=before)
    # On SIGTERM uvicorn stops accepting, lets requests in flight finish (up to drain_s), then the app's lifespan
    # closes the engine and the database; every write was awaited before its response, so none is pending.
    server = uvicorn.Server(server_config(starting, settings))
    starting.on_ready = lambda: stage(f"ready on {url} after {progress.elapsed():.1f} s")
    starting.on_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    if starting.failed is not None:
        if isinstance(starting.failed, CalmError):
            raise starting.failed
        raise CalmError(f"the gateway did not start: {type(starting.failed).__name__}: {starting.failed}")


@commands.command("engine")
@one_line_errors
def engine(
    host: str = "127.0.0.1",
    port: int = 8001,
    artifact: Annotated[Optional[Path], typer.Option(help="alpha-head artifact; default: the model's shipped one")] = None,
):
    """Start a vLLM OpenAI server with the α-head logits processor, for gateways with CALM_ENGINE=upstream."""
    from calm_cli.serving import engine_server_command

    settings = gateway_settings(**({"artifact": str(artifact)} if artifact else {}))
    argv, env, allocator = engine_server_command(settings, host, port)
    typer.echo(allocator)
    typer.echo("exec " + " ".join(argv))
    os.execve(argv[0], argv, env)


@commands.command("worker")
@one_line_errors
def worker(
    config: Annotated[Path, typer.Option(help="loop config (TOML)")] = Path("configs/loop.toml"),
    once: Annotated[bool, typer.Option(help="run the waiting jobs, then exit")] = False,
    lease_s: Annotated[float, typer.Option(help="a running job silent this long was left by a dead worker")] = 60.0,
    name: Annotated[Optional[str], typer.Option(help="this worker's name in the jobs table")] = None,
    launcher: Annotated[Optional[str], typer.Option(help="run training as `calm train` under this command, e.g. "
                                                         "'accelerate launch --num_processes 4' on a GPU node")] = None,
):
    """Run retraining jobs: CALM on a drifting domain's captured prompts, the gate, promotion (another process than
    the gateway; several workers may share one database)."""
    # torch, through the trainer the worker runs and the gate's scoring
    from calm_cli.serving import offline_engines
    from calm_core.db import Database
    from training.retrain.gate import load_loop_config
    from training.retrain.worker import Worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = gateway_settings()
    # Free-form modes are judged as served: vLLM in process, one engine per artifact scored.
    runner = Worker(load_loop_config(config), Database(settings.database), settings.registry_root, name, lease_s,
                    settings.model, launcher, engines=offline_engines(settings), registry_url=settings.registry_url)
    typer.echo(f"calm worker {runner.name}: jobs from {settings.database}")
    runner.run(once=once)
