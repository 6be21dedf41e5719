"""Training and what it starts from: `calm train` (one method), `calm report` (every method, the comparison),
`calm model prepare` (the embedded model's weights) and `calm split show` (a domain split's questions)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from adapters.hosting.cpu_limits import process_threads
from calm_cli.common import one_line_errors
from calm_core.models import prepare_embedded, read_model_manifest

commands = typer.Typer()
model_app = typer.Typer(help="Prepare and inspect models.", no_args_is_help=True)
split_app = typer.Typer(help="Inspect domain splits.", no_args_is_help=True)


@commands.command("train")
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
    from calm_cli.serving import offline_engines
    from training.config import load_config

    import torch

    from training.trainer import Trainer  # torch

    torch.set_num_threads(process_threads())
    cfg = load_config(config, method=method, seed=seed, steps=steps, out_dir=str(out) if out else None)
    trainer = Trainer(cfg).setup()
    if resume and trainer.resume():
        typer.echo(f"resumed from step {trainer.step}")
    trainer.train()
    if trainer.fmt.generative:  # free-form answers are measured as served, after export (vLLM, as the gateway)
        from training.free_form_eval import measure_artifact  # torch

        path = trainer.export({}, merged=merged)
        split = trainer.split
        tests = {f"{prefix}/{label}": qs for role, prefix in (("test_in_domain", "in_domain"),
                                                              ("test_out_of_domain", "out_of_domain"))
                 for label, qs in split.sources[role].items()}
        held_out = [q for role in ("calibration", "test_in_domain", "test_out_of_domain") for q in split.role(role)]
        metrics = measure_artifact(offline_engines(), path, trainer.resolved.path, tests, held_out)
    else:
        metrics = trainer.evaluate()
        path = trainer.export(metrics, merged=merged)
    for name, m in metrics.items():
        typer.echo(f"{name:40s} acc {m['accuracy']:.3f}  ECE-10 {m['ece_10']:.3f}  AUROC {m['auroc']:.3f}")
    typer.echo(f"artifact: {path}")


@commands.command("report")
@one_line_errors
def report_cmd(
    task: Annotated[str, typer.Option(help="multiple-choice | open-ended")] = "multiple-choice",
    config: Annotated[Optional[Path], typer.Option(help="base training config (TOML); default per task")] = None,
    seeds: Annotated[list[int], typer.Option("--seed", help="repeatable")] = [0, 1, 2],
    quick: Annotated[bool, typer.Option(help="one seed and a quarter of the steps (open-ended: also 4 samples and "
                                              "50 test questions per role)")] = False,
    steps: Annotated[Optional[int], typer.Option(help="override the config's steps for every method")] = None,
    samples: Annotated[int, typer.Option(help="open-ended: sampled answers per question for semantic confidence")] = 8,
    out: Annotated[Optional[Path], typer.Option(help="report folder; default per task")] = None,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="multiple-choice: rerun just these trained "
                                                      "methods (repeatable; sft also gives the post-hoc rows), "
                                                      "merged into the report in --out")] = None,
):
    """Run every method (CALM, ablations, baselines) on the declared split(s); write report.json/.md and plots.
    open-ended: PopQA -> TriviaQA and TriviaQA -> PopQA, free-form answers evaluated as served."""
    from calm_cli.serving import offline_engines
    from training.config import load_config

    import torch

    if task not in ("multiple-choice", "open-ended"):
        raise typer.BadParameter(f"--task must be multiple-choice or open-ended, not {task!r}")
    open_ended = task == "open-ended"
    torch.set_num_threads(process_threads())
    base = load_config(config or Path("configs/train/open.toml" if open_ended else "configs/train/calm.toml"))
    steps = steps or (max(base.steps // 4, 10) if quick else None)
    out = out or Path("reports/open-ended" if open_ended else "reports/calm")
    if open_ended:
        from training.open_report import run_open_report  # torch

        run_open_report(offline_engines(), base, seeds[:1] if quick else list(seeds), out, steps,
                        4 if quick else samples, limit=50 if quick else None)
        typer.echo((out / "report.md").read_text())
        typer.echo(f"wrote {out}/report.json, report.md, reliability-*.png")
        return
    from training.report import run_report  # torch

    summary = run_report(base, seeds[:1] if quick else list(seeds), out, steps, only)
    typer.echo((out / "report.md").read_text())
    typer.echo(f"wrote {out}/report.json, report.md, reliability.png, curves.png ({len(summary['table'])} rows)")


@model_app.command("prepare")
@one_line_errors
def model_prepare(
    dtype: Annotated[str, typer.Option(help="float32, bfloat16 or float16")] = "float32",
    force: Annotated[bool, typer.Option(help="convert again even if the cache is current")] = False,
):
    """Convert the embedded SmolLM2-135M-Instruct GGUF to a safetensors folder in $CALM_HOME (once)."""
    path = prepare_embedded(dtype, force=force)
    manifest = read_model_manifest(path)
    typer.echo(f"{path}  (source sha256 {manifest['source_sha256'][:12]}…, {manifest['dtype']})")


@split_app.command("show")
@one_line_errors
def split_show(path: Path):
    """Validate a split config, apply it to the data, and print the question count per role and source."""
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
