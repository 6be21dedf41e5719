"""`calm` command line. Subcommands import their heavy modules lazily so `calm --help` stays instant.

User errors (CalmError) print one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from calm_core.errors import CalmError

app = typer.Typer(help="CALM Gateway: calibrated LLM confidence.", no_args_is_help=True, add_completion=False)
model_app = typer.Typer(help="Prepare and inspect models.", no_args_is_help=True)
artifact_app = typer.Typer(help="Create and inspect alpha-head artifacts.", no_args_is_help=True)
app.add_typer(model_app, name="model")
split_app = typer.Typer(help="Inspect domain splits.", no_args_is_help=True)
app.add_typer(artifact_app, name="artifact")
app.add_typer(split_app, name="split")
policy_app = typer.Typer(help="Abstention policies offline.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")


def one_line_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CalmError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return wrapper


@model_app.command("prepare")
@one_line_errors
def model_prepare(
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    force: Annotated[bool, typer.Option(help="convert again even if the cache is current")] = False,
):
    """Convert the embedded SmolLM2-135M-Instruct GGUF to a safetensors folder in $CALM_HOME (once)."""
    from calm_core.models import prepare_embedded, read_model_manifest

    path = prepare_embedded(dtype, force=force)
    manifest = read_model_manifest(path)
    typer.echo(f"{path}  (source sha256 {manifest['source_sha256'][:12]}…, {manifest['dtype']})")


@artifact_app.command("identity")
@one_line_errors
def artifact_identity(
    out: Annotated[Path, typer.Option(help="artifact folder to write")],
    model: Annotated[Optional[str], typer.Option(help="model folder or hub id; default: embedded")] = None,
    reference: Annotated[bool, typer.Option(help="score the bundled questions for reference histograms")] = True,
):
    """Write an identity α head (d = 1, l = 0) for a model: serving without calibration, same code path."""
    from training.artifacts import write_identity_artifact

    manifest = write_identity_artifact(out, model, with_reference=reference)
    typer.echo(f"{out}  ({manifest.artifact_version})")


@artifact_app.command("show")
@one_line_errors
def artifact_show(path: Path):
    """Verify an artifact and print its manifest."""
    from calm_core.artifact import load_artifact

    loaded = load_artifact(path)
    typer.echo(loaded.manifest.model_dump_json(indent=2))


@split_app.command("show")
@one_line_errors
def split_show(path: Path):
    """Validate a split config, apply it to the data, and print the question count per role and source."""
    from rich.console import Console
    from rich.table import Table

    from calm_core.splits import ROLES, load_split, materialize

    m = materialize(load_split(path))
    table = Table(title=f"split {m.config.name!r} (seed {m.config.seed})")
    for col in ("role", "source", "questions"):
        table.add_column(col)
    for role in ROLES:
        for label, qs in m.sources[role].items():
            table.add_row(role, label, str(len(qs)))
    Console().print(table)
    typer.echo(f"dropped as test duplicates: train {m.dropped['train']}, calibration {m.dropped['calibration']}")


@app.command("eval")
@one_line_errors
def eval_cmd(
    dataset: Annotated[list[str], typer.Option("--dataset", "-d", help="name[:split] or a .jsonl file, repeatable")] = [],
    all_mc: Annotated[bool, typer.Option(help="every multiple-choice dataset, default splits")] = False,
    model: Annotated[Optional[str], typer.Option(help="model folder or hub id (default: embedded); with --gateway, "
                                                      "the served model name (default: the first it lists)")] = None,
    artifact: Annotated[Optional[Path], typer.Option(help="artifact to score as the gateway serves it (adapter, "
                                                          "answer format, α head)")] = None,
    answer_format: Annotated[Optional[str], typer.Option(help="letter or cloze (default: the artifact's, else letter)")] = None,
    gateway: Annotated[Optional[str], typer.Option(help="evaluate a running gateway at this URL instead")] = None,
    api_key: Annotated[str, typer.Option(envvar="CALM_API_KEY", help="API key for --gateway")] = "unused",
    concurrency: Annotated[int, typer.Option(help="requests in flight with --gateway")] = 8,
    limit: Annotated[int, typer.Option(help="questions per dataset (0 = all)")] = 300,
    seed: int = 0,
    batch_size: int = 8,
    dtype: str = "float32",
    out: Annotated[Path, typer.Option(help="report folder")] = Path("reports/eval"),
):
    """Score multiple-choice sets offline (a model, or an artifact as served) or through a live gateway; write
    report.json, report.md, reliability.png and each question's option probabilities."""
    from calm_core.data import MC_DATASETS
    from training.evaluate import DatasetSpec

    names = list(dataset) + (list(MC_DATASETS) if all_mc else [])
    if not names:
        raise CalmError("name at least one --dataset, or pass --all-mc")
    if answer_format not in (None, "letter", "cloze"):
        raise CalmError(f"--answer-format must be letter or cloze, not {answer_format!r}")
    specs = tuple(DatasetSpec.parse(n) for n in names)
    if gateway:
        if artifact or answer_format:
            raise CalmError("--gateway evaluates what the gateway serves: --artifact and --answer-format do not apply")
        from training.gateway_eval import GatewayEvalConfig, run_gateway_eval

        summary = run_gateway_eval(GatewayEvalConfig(url=gateway, datasets=specs, api_key=api_key, model=model,
                                                     limit=limit or None, seed=seed, concurrency=concurrency,
                                                     out_dir=str(out)))
    else:
        from training.evaluate import EvalConfig, run_eval

        summary = run_eval(EvalConfig(datasets=specs, model=model, artifact=str(artifact) if artifact else None,
                                      answer_format=answer_format, limit=limit or None, seed=seed,
                                      batch_size=batch_size, dtype=dtype, out_dir=str(out)))
    typer.echo((out / "report.md").read_text())
    typer.echo(f"wrote {out}/report.json, report.md, reliability.png  ({len(summary['results'])} datasets)")


@policy_app.command("fit")
@one_line_errors
def policy_fit(
    artifact: Annotated[Path, typer.Option(help="artifact to score the questions with, as the gateway serves it")],
    dataset: Annotated[str, typer.Option(help="labelled questions: name[:split] or a .jsonl file")],
    target_risk: Annotated[float, typer.Option(help="α: the largest error rate allowed among the answers let through")],
    delta: Annotated[float, typer.Option(help="δ: the promise may fail with at most this probability")] = 0.1,
    limit: Annotated[int, typer.Option(help="questions (0 = all)")] = 0,
    domain: Annotated[str, typer.Option(help="reference domain of the artifact (sequence start, label-free threshold)")] = "all",
    out: Annotated[Path, typer.Option(help="output folder")] = Path("reports/policy-fit"),
):
    """Guaranteed abstention threshold (Learn-then-Test) for an artifact on labelled questions; prints it with its
    coverage, writes fit.json, scores.npz and selective_risk.png."""
    from training.evaluate import DatasetSpec
    from training.policy_fit import PolicyFitConfig, run_policy_fit

    if not (0 < target_risk < 1 and 0 < delta < 1):
        raise CalmError("--target-risk and --delta must be between 0 and 1")
    s = run_policy_fit(PolicyFitConfig(artifact=str(artifact), dataset=DatasetSpec.parse(dataset), target_risk=target_risk,
                                       delta=delta, limit=limit or None, domain=domain, out_dir=str(out)))
    g, lf = s["guaranteed"], s["label_free"]
    if g["threshold"] is None:
        typer.echo(f"no threshold keeps error ≤ {target_risk} with probability ≥ {1 - delta} on {s['n']} labels: "
                   "abstain on everything, or accept a larger risk")
    else:
        typer.echo(f"guaranteed threshold {g['threshold']:.2f}: coverage {g['coverage']:.3f}, error rate of the answers "
                   f"let through {g['selective_risk']:.3f} on {s['n']} labels (α = {target_risk}, δ = {delta})")
    typer.echo(f"label-free threshold {lf['threshold']:.2f}: coverage {lf['coverage']:.3f} (no guarantee)")
    typer.echo(f"wrote {out}/fit.json, scores.npz, selective_risk.png")


@app.command("train")
@one_line_errors
def train_cmd(
    config: Annotated[Path, typer.Option(help="training config (TOML)")],
    method: Annotated[Optional[str], typer.Option(help="override the config's method")] = None,
    seed: Annotated[Optional[int], typer.Option(help="override the config's seed")] = None,
    steps: Annotated[Optional[int], typer.Option(help="override the config's steps")] = None,
    out: Annotated[Optional[Path], typer.Option(help="override the config's out_dir")] = None,
    resume: Annotated[bool, typer.Option(help="continue from out_dir/checkpoint.pt if present")] = True,
    merged: Annotated[bool, typer.Option(help="also write base+LoRA merged weights (out_dir/merged)")] = False,
):
    """Train CALM (or a baseline) with LoRA on the top layers; write the artifact to out_dir/artifact."""
    import torch

    from training.config import load_config
    from training.trainer import Trainer

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
    cfg = load_config(config, method=method, seed=seed, steps=steps, out_dir=str(out) if out else None)
    trainer = Trainer(cfg).setup()
    if resume and trainer.resume():
        typer.echo(f"resumed from step {trainer.step}")
    trainer.train()
    metrics = trainer.evaluate()
    path = trainer.export(metrics, merged=merged)
    for name, m in metrics.items():
        typer.echo(f"{name:40s} acc {m['accuracy']:.3f}  ECE-10 {m['ece_10']:.3f}  AUROC {m['auroc']:.3f}")
    typer.echo(f"artifact: {path}")


@app.command("report")
@one_line_errors
def report_cmd(
    config: Annotated[Path, typer.Option(help="base training config (TOML)")] = Path("configs/train/calm.toml"),
    seeds: Annotated[list[int], typer.Option("--seed", help="repeatable")] = [0, 1, 2],
    quick: Annotated[bool, typer.Option(help="one seed and a quarter of the steps")] = False,
    steps: Annotated[Optional[int], typer.Option(help="override the config's steps for every method")] = None,
    out: Annotated[Path, typer.Option(help="report folder")] = Path("reports/calm"),
):
    """Run every method (CALM, ablations, baselines) on the declared split; write report.json/.md and plots."""
    import torch

    from training.config import load_config
    from training.report import run_report

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
    base = load_config(config)
    steps = steps or (max(base.steps // 4, 10) if quick else None)
    summary = run_report(base, seeds[:1] if quick else list(seeds), out, steps)
    typer.echo((out / "report.md").read_text())
    typer.echo(f"wrote {out}/report.json, report.md, reliability.png, curves.png ({len(summary['table'])} rows)")


@app.command("serve")
@one_line_errors
def serve(
    host: Annotated[Optional[str], typer.Option(help="default: CALM_HOST or 127.0.0.1")] = None,
    port: Annotated[Optional[int], typer.Option(help="default: CALM_PORT or 8000")] = None,
    artifact: Annotated[Optional[Path], typer.Option(help="alpha-head artifact; default: the model's shipped one")] = None,
):
    """Run the gateway: OpenAI-compatible API with calibrated confidence (settings from CALM_* variables)."""
    import uvicorn
    from pydantic import ValidationError

    from calm_cli.serving import build_gateway
    from gateway.settings import GatewaySettings

    try:
        settings = GatewaySettings(**{k: v for k, v in {"host": host, "port": port, "artifact": str(artifact) if artifact else None}.items() if v is not None})
    except ValidationError as e:
        raise CalmError(f"invalid settings: {e.errors()[0]['msg']}") from None
    app_ = build_gateway(settings)
    typer.echo(f"CALM Gateway on http://{settings.host}:{settings.port}  (model {settings.served_model_name}, engine {settings.engine.value})")
    uvicorn.run(app_, host=settings.host, port=settings.port, log_level="info", access_log=False)


@app.command("engine")
@one_line_errors
def engine(
    host: str = "127.0.0.1",
    port: int = 8001,
    artifact: Annotated[Optional[Path], typer.Option(help="alpha-head artifact; default: the model's shipped one")] = None,
):
    """Start a vLLM OpenAI server with the α-head logits processor, for gateways with CALM_ENGINE=upstream."""
    import os

    from calm_cli.serving import engine_server_command
    from gateway.settings import GatewaySettings

    settings = GatewaySettings(**({"artifact": str(artifact)} if artifact else {}))
    argv, env = engine_server_command(settings, host, port)
    typer.echo("exec " + " ".join(argv))
    os.execve(argv[0], argv, env)


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
