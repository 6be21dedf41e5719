"""The `calm artifacts` commands that write an artifact folder, before `calm artifacts add` registers it: an identity
head, a multiple-choice artifact with a free-form one inside, a free-form mode's semantic map, a recalibrated
version. artifacts.py registers them in the group."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from calm_cli.common import one_line_errors


@one_line_errors
def identity(
    out: Annotated[Path, typer.Option(help="artifact folder to write")],
    model: Annotated[Optional[str], typer.Option(help="model folder or hub id; default: embedded")] = None,
    reference: Annotated[bool, typer.Option(help="score the bundled questions for reference histograms")] = True,
):
    """Write an identity α head (d = 1, l = 0) for a model: serving without calibration, same code path."""
    from training.artifacts import write_identity_artifact  # torch

    manifest = write_identity_artifact(out, model, with_reference=reference)
    typer.echo(f"{out}  ({manifest.artifact_version})")


@one_line_errors
def attach_free_form(
    multiple_choice: Annotated[Path, typer.Option(help="artifact fitted to multiple choice")],
    free_form: Annotated[Path, typer.Option(help="artifact fitted to free-form answers (answer_format generative)")],
    out: Annotated[Path, typer.Option(help="where to write the combined artifact")],
):
    """One artifact for every request: the multiple-choice artifact with the free-form one inside (a new version)."""
    from calm_core.artifact import attach_free_form as attach

    manifest = attach(multiple_choice, free_form, out)
    typer.echo(f"{out}: {manifest.artifact_version} (free form: {manifest.free_form_version})")


@one_line_errors
def fit_semantic(
    artifact: Annotated[Path, typer.Option(help="artifact whose free-form mode gets the map (before it is registered)")],
    dataset: Annotated[str, typer.Option("--dataset", "-d", help="open-ended prompts of the domain, e.g. triviaqa:sample@0.5-0.7")],
    limit: Annotated[int, typer.Option(help="questions (0 = all)")] = 200,
    samples: Annotated[int, typer.Option(help="answers sampled per question")] = 8,
    labels: Annotated[bool, typer.Option(help="fit to right/wrong (alias match) instead of the mode's token confidence")] = False,
    answers: Annotated[Optional[Path], typer.Option(help="refit from an earlier fit's answers.jsonl (same questions)")] = None,
    out: Annotated[Path, typer.Option(help="output folder")] = Path("reports/semantic-fit"),
):
    """Fit the free-form mode's semantic-confidence map (agreement share -> probability), label-free by default, and
    write it into the mode's manifest (as metrics and reference histograms are written after export)."""
    from calm_cli.serving import offline_engines
    from training.dataset_spec import DatasetSpec
    from training.semantic_fit import SemanticFitConfig, run_semantic_fit  # torch

    s = run_semantic_fit(offline_engines(), SemanticFitConfig(str(artifact), DatasetSpec.parse(dataset), limit or None,
                                                           samples, use_labels=labels, out_dir=str(out),
                                                           answers=str(answers) if answers else None))
    c = s["calibration"]
    typer.echo(f"{s['artifact']}: confidence = sigmoid({c['slope']:.3f} * logit(share) + {c['intercept']:.3f}) "
               f"on {c['fitted_on']}; mean share {s['mean_share']:.3f}, mean target {s['mean_target']:.3f}, "
               f"mean semantic confidence {s['mean_semantic_confidence']:.3f}; wrote {out}/fit.json")


@one_line_errors
def recalibrate(
    artifact: Annotated[Path, typer.Option(help="the version serving the domain now (its folder)")],
    labels: Annotated[str, typer.Option(help="labelled questions of the domain: name[:split][@range] or .jsonl; "
                                              "open-ended ones (answers aliases) recalibrate the free-form mode")],
    domain: Annotated[str, typer.Option(help="the domain the new version is for (its reference histogram)")],
    out: Annotated[Path, typer.Option(help="folder of the new version")],
    limit: Annotated[int, typer.Option(help="questions (0 = all)")] = 0,
    held_out: Annotated[float, typer.Option(help="share of the labels kept to check the fit")] = 1 / 3,
    seed: Annotated[int, typer.Option(help="seed of the question sample and the split")] = 0,
):
    """Fit a temperature on the version's option scores (multiple-choice labels) or on its free-form answers' token
    log-probs (open-ended labels) to a domain's labels (no training) and, if it passes its held-out check (ECE falls,
    AUROC does not), write it as a new version (register and promote it with `calm artifacts`)."""
    from calm_cli.serving import offline_engines
    from training.dataset_spec import DatasetSpec
    from training.recalibrate import RecalibrateConfig, run_recalibrate, run_recalibrate_free_form  # torch

    cfg = RecalibrateConfig(str(artifact), DatasetSpec.parse(labels), domain, str(out), limit or None, held_out, seed)
    if cfg.labels.open_ended:
        s = run_recalibrate_free_form(cfg, offline_engines())
        typer.echo(f"{out}: {s['version']} (free-form token temperature {s['token_temperature']:.3f}, parent "
                   f"{s['parent']}); {s['reason']}")
    else:
        s = run_recalibrate(cfg)
        typer.echo(f"{out}: {s['version']} (option temperature {s['option_temperature']:.3f}, parent {s['parent']}); "
                   f"{s['reason']}")
    typer.echo(f"register it and serve {domain} with it: calm artifacts add {out} --promote")
