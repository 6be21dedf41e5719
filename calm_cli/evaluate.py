"""Measuring confidence: `calm eval` (labelled sets offline, or through a live gateway) and `calm policy fit` (a
guaranteed abstention threshold on labelled questions)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from calm_cli.common import one_line_errors
from calm_core.data import MC_DATASETS
from calm_core.errors import CalmError
from calm_core.prompts import AnswerFormat

if TYPE_CHECKING:
    from training.dataset_spec import DatasetSpec

commands = typer.Typer()
policy_app = typer.Typer(help="Abstention policies offline.", no_args_is_help=True)


def _dataset_specs(names: list[str], answer_format: str | None, offline: bool, domain: str | None,
                   artifact: Path | None) -> tuple[DatasetSpec, ...]:
    """The sets `calm eval` scores, refused where its options do not go together."""
    from training.dataset_spec import DatasetSpec

    if not names:
        raise CalmError("name at least one --dataset, or pass --all-mc")
    if answer_format not in (None, AnswerFormat.LETTER, AnswerFormat.CLOZE):
        raise CalmError(f"--answer-format must be letter or cloze, not {answer_format!r}")
    specs = tuple(DatasetSpec.parse(n) for n in names)
    if any(s.open_ended for s in specs) and (not all(s.open_ended for s in specs) or answer_format):
        raise CalmError("open-ended sets (triviaqa, popqa) are evaluated alone (not with multiple-choice sets), "
                        "without --answer-format")
    if domain is not None and offline:
        raise CalmError("--domain names the domain questions are asked in through --gateway; offline, --artifact "
                        "names the version to score")
    if not offline and (artifact or answer_format):
        raise CalmError("--gateway evaluates what the gateway serves: --artifact and --answer-format do not apply")
    return specs


@commands.command("eval")
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
    domain: Annotated[Optional[str], typer.Option(help="with --gateway: ask every question in this domain, so the "
                                                       "version serving it answers (default: each question's own)")] = None,
    limit: Annotated[int, typer.Option(help="questions per dataset (0 = all)")] = 300,
    seed: int = 0,
    batch_size: int = 8,
    dtype: str = "float32",
    samples: Annotated[int, typer.Option(help="open-ended sets: sampled answers per question (semantic confidence)")] = 8,
    out: Annotated[Path, typer.Option(help="report folder")] = Path("reports/eval"),
):
    """Score multiple-choice sets offline (a model, or an artifact as served) or through a live gateway; write
    report.json, report.md, reliability.png and each question's option probabilities. Open-ended sets (triviaqa,
    popqa; 'triviaqa:sample@0.7-0.8' for a range) are answered by the artifact's free-form mode through vLLM."""
    from calm_cli.serving import offline_engines

    specs = _dataset_specs(list(dataset) + (list(MC_DATASETS) if all_mc else []), answer_format, not gateway, domain,
                           artifact)
    if any(s.open_ended for s in specs) and not gateway:
        from training.free_form_eval import run_free_form_eval  # torch

        run_free_form_eval(offline_engines(), specs, str(artifact) if artifact else None, model, limit or None, seed,
                           samples, out)
        typer.echo((out / "report.md").read_text())
        return
    if gateway:
        from training.gateway_eval import GatewayEvalConfig, run_gateway_eval  # torch

        summary = run_gateway_eval(GatewayEvalConfig(url=gateway, datasets=specs, api_key=api_key, model=model,
                                                     limit=limit or None, seed=seed, concurrency=concurrency,
                                                     out_dir=str(out), samples=samples if specs[0].open_ended else 0,
                                                     domain=domain))
    else:
        from training.evaluate import EvalConfig, run_eval  # torch

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
    action: Annotated[str, typer.Option(help="abstain, escalate or review: what happens below the threshold")] = "abstain",
):
    """Guaranteed abstention threshold (Learn-then-Test) for an artifact on labelled questions; prints it with its
    coverage (escalate/review: the share handed off and the error rate of the answers kept), writes fit.json,
    scores.npz and selective_risk.png."""
    from training.dataset_spec import DatasetSpec
    from training.policy_fit import PolicyFitConfig, run_policy_fit  # torch

    if not (0 < target_risk < 1 and 0 < delta < 1):
        raise CalmError("--target-risk and --delta must be between 0 and 1")
    if action not in ("abstain", "escalate", "review"):
        raise CalmError("--action must be abstain, escalate or review")
    s = run_policy_fit(PolicyFitConfig(artifact=str(artifact), dataset=DatasetSpec.parse(dataset), target_risk=target_risk,
                                       delta=delta, limit=limit or None, domain=domain, out_dir=str(out), action=action))
    g, lf = s["guaranteed"], s["label_free"]
    handed = {"abstain": "withheld", "escalate": "escalated", "review": "sent to review"}[action]
    if g["threshold"] is None:
        typer.echo(f"no threshold keeps error ≤ {target_risk} with probability ≥ {1 - delta} on {s['n']} labels: "
                   f"every answer would be {handed}; accept a larger risk")
    else:
        typer.echo(f"guaranteed threshold {g['threshold']:.2f}: {g['handed_off']:.1%} of answers {handed}, error rate of "
                   f"the answers kept {g['selective_risk']:.3f} on {s['n']} labels (α = {target_risk}, δ = {delta})")
    if lf["threshold"] is not None:
        kept = f"{lf['selective_risk']:.3f}" if lf["selective_risk"] is not None else "n/a"
        typer.echo(f"label-free threshold {lf['threshold']:.2f}: {lf['handed_off']:.1%} {handed}, error rate of the "
                   f"answers kept {kept} (no guarantee)")
    typer.echo(f"wrote {out}/fit.json, scores.npz, selective_risk.png")
