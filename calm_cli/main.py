"""`calm` command line. Subcommands import their heavy modules lazily so `calm --help` stays instant.

User errors (CalmError) print one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from calm_cli.common import gateway_settings, one_line_errors, open_store, served_domain
from calm_cli.registry_commands import artifacts_app, jobs_app
from calm_core.errors import CalmError
from calm_core.prompts import AnswerFormat

app = typer.Typer(help="CALM Gateway: calibrated LLM confidence.", no_args_is_help=True, add_completion=False)
model_app = typer.Typer(help="Prepare and inspect models.", no_args_is_help=True)
artifact_app = typer.Typer(help="Create and inspect alpha-head artifacts.", no_args_is_help=True)
app.add_typer(model_app, name="model")
split_app = typer.Typer(help="Inspect domain splits.", no_args_is_help=True)
app.add_typer(artifact_app, name="artifact")
app.add_typer(split_app, name="split")
policy_app = typer.Typer(help="Abstention policies offline.", no_args_is_help=True)
app.add_typer(policy_app, name="policy")
keys_app = typer.Typer(help="Client API keys for /v1/* (in the gateway's database, CALM_DB_PATH).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(artifacts_app, name="artifacts")
app.add_typer(jobs_app, name="jobs")


def _offline_engines(settings=None):
    """The engine factory of offline scoring (`calm eval`, reports, the worker's judging): vLLM in process, with the
    gateway's engine settings where set (CALM_KV_CACHE_MB, CALM_ENGINE_START, ...), read through its own settings."""
    from functools import partial

    from adapters.clients.inprocess import artifact_engine

    return partial(artifact_engine, overrides=(settings or gateway_settings()).engine_overrides())


@keys_app.command("create")
@one_line_errors
def keys_create(
    name: Annotated[str, typer.Option(help="who or what the key is for")],
    domain: Annotated[Optional[list[str]], typer.Option("--domain", help="allowed domain (repeatable); all if none")] = None,
    rate: Annotated[Optional[float], typer.Option(help="requests per minute (token bucket); unlimited if unset")] = None,
    labeller: Annotated[bool, typer.Option(help="may give feedback on answers other keys received")] = False,
    sequences: Annotated[Optional[int], typer.Option(
        "--sequences-per-minute", help="engine sequences per minute over every replica; unlimited if unset")] = None,
):
    """Create a key and print it once (only its hash is stored). Running gateways see it within seconds."""
    from gateway.edge.keys import issue_key

    if rate is not None and rate <= 0:
        raise typer.BadParameter("--rate must be positive")
    if sequences is not None and sequences <= 0:
        raise typer.BadParameter("--sequences-per-minute must be positive")
    for name_ in domain or []:
        served_domain(name_, other=True)
    created = issue_key(open_store(), name, list(domain) if domain else None, rate, labeller, sequences)
    typer.echo(f"{created.key}\n(id {created.id}; shown once, store it now)")


@keys_app.command("list")
@one_line_errors
def keys_list():
    """Every key: id, name, domains, rate, and whether it is revoked (never the key itself)."""
    for key, _ in open_store().client_keys():
        state = "revoked" if key.revoked_at else "active"
        domains = ",".join(key.domains) if key.domains else "*"
        rate = f"{key.requests_per_minute:g}/min" if key.requests_per_minute else "unlimited"
        typer.echo(f"{key.id}  {state:7s}  {key.name}  domains={domains}  rate={rate}" + ("  labeller" if key.labeller else ""))


@keys_app.command("revoke")
@one_line_errors
def keys_revoke(key_id: str):
    """Revoke a key by id; gateways refuse it within seconds."""
    if not open_store().revoke_client_key(key_id):
        raise CalmError(f"no active API key with id {key_id!r}")
    typer.echo(f"revoked {key_id}")


reviews_app = typer.Typer(help="The review queue of review policies (in the gateway's database, CALM_DB_PATH).",
                          no_args_is_help=True)
app.add_typer(reviews_app, name="reviews")


@reviews_app.command("list")
@one_line_errors
def reviews_list(
    status: Annotated[str, typer.Option(help="open, closed or all")] = "open",
    domain: Annotated[Optional[str], typer.Option(help="only this domain")] = None,
    limit: Annotated[int, typer.Option(help="at most this many, oldest first")] = 100,
):
    """Reviews, oldest first, one JSON line each: id, domain, when it was queued and how long it waited (so far, if
    open), the withheld answer (a multiple-choice letter with its option's text) and its confidence, the request, and
    the verdict once closed. Close one with POST /admin/reviews/{id} on a gateway."""
    import time
    from datetime import datetime, timezone

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


@artifact_app.command("attach-free-form")
@one_line_errors
def artifact_attach_free_form(
    multiple_choice: Annotated[Path, typer.Option(help="artifact fitted to multiple choice")],
    free_form: Annotated[Path, typer.Option(help="artifact fitted to free-form answers (answer_format generative)")],
    out: Annotated[Path, typer.Option(help="where to write the combined artifact")],
):
    """One artifact for every request: the multiple-choice artifact with the free-form one inside (a new version)."""
    from calm_core.artifact import attach_free_form

    manifest = attach_free_form(multiple_choice, free_form, out)
    typer.echo(f"{out}: {manifest.artifact_version} (free form: {manifest.free_form_version})")


@artifact_app.command("fit-semantic")
@one_line_errors
def artifact_fit_semantic(
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
    from training.dataset_spec import DatasetSpec
    from training.semantic_fit import SemanticFitConfig, run_semantic_fit

    s = run_semantic_fit(_offline_engines(), SemanticFitConfig(str(artifact), DatasetSpec.parse(dataset), limit or None,
                                                            samples, use_labels=labels, out_dir=str(out),
                                                            answers=str(answers) if answers else None))
    c = s["calibration"]
    typer.echo(f"{s['artifact']}: confidence = sigmoid({c['slope']:.3f} * logit(share) + {c['intercept']:.3f}) "
               f"on {c['fitted_on']}; mean share {s['mean_share']:.3f}, mean target {s['mean_target']:.3f}, "
               f"mean semantic confidence {s['mean_semantic_confidence']:.3f}; wrote {out}/fit.json")


@artifact_app.command("recalibrate")
@one_line_errors
def artifact_recalibrate(
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
    from training.dataset_spec import DatasetSpec
    from training.recalibrate import RecalibrateConfig, run_recalibrate, run_recalibrate_free_form

    cfg = RecalibrateConfig(str(artifact), DatasetSpec.parse(labels), domain, str(out), limit or None, held_out, seed)
    if cfg.labels.open_ended:
        s = run_recalibrate_free_form(cfg, _offline_engines())
        typer.echo(f"{out}: {s['version']} (free-form token temperature {s['token_temperature']:.3f}, parent "
                   f"{s['parent']}); {s['reason']}")
    else:
        s = run_recalibrate(cfg)
        typer.echo(f"{out}: {s['version']} (option temperature {s['option_temperature']:.3f}, parent {s['parent']}); "
                   f"{s['reason']}")
    typer.echo(f"register it and serve {domain} with it: calm artifacts add {out} --promote")


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
    from calm_core.data import MC_DATASETS
    from training.dataset_spec import DatasetSpec

    names = list(dataset) + (list(MC_DATASETS) if all_mc else [])
    if not names:
        raise CalmError("name at least one --dataset, or pass --all-mc")
    if answer_format not in (None, AnswerFormat.LETTER, AnswerFormat.CLOZE):
        raise CalmError(f"--answer-format must be letter or cloze, not {answer_format!r}")
    specs = tuple(DatasetSpec.parse(n) for n in names)
    if any(s.open_ended for s in specs) and (not all(s.open_ended for s in specs) or answer_format):
        raise CalmError("open-ended sets (triviaqa, popqa) are evaluated alone (not with multiple-choice sets), "
                        "without --answer-format")
    if domain is not None and not gateway:
        raise CalmError("--domain names the domain questions are asked in through --gateway; offline, --artifact "
                        "names the version to score")
    if any(s.open_ended for s in specs) and not gateway:
        from training.free_form_eval import run_free_form_eval

        summary = run_free_form_eval(_offline_engines(), specs, str(artifact) if artifact else None, model, limit or None,
                                     seed, samples, out)
        typer.echo((out / "report.md").read_text())
        return
    if gateway:
        if artifact or answer_format:
            raise CalmError("--gateway evaluates what the gateway serves: --artifact and --answer-format do not apply")
        from training.gateway_eval import GatewayEvalConfig, run_gateway_eval

        summary = run_gateway_eval(GatewayEvalConfig(url=gateway, datasets=specs, api_key=api_key, model=model,
                                                     limit=limit or None, seed=seed, concurrency=concurrency,
                                                     out_dir=str(out), samples=samples if specs[0].open_ended else 0,
                                                     domain=domain))
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
    action: Annotated[str, typer.Option(help="abstain, escalate or review: what happens below the threshold")] = "abstain",
):
    """Guaranteed abstention threshold (Learn-then-Test) for an artifact on labelled questions; prints it with its
    coverage (escalate/review: the share handed off and the error rate of the answers kept), writes fit.json,
    scores.npz and selective_risk.png."""
    from training.dataset_spec import DatasetSpec
    from training.policy_fit import PolicyFitConfig, run_policy_fit

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

    from adapters.hosting.cpu_limits import process_threads
    from training.config import load_config
    from training.trainer import Trainer

    torch.set_num_threads(process_threads())
    cfg = load_config(config, method=method, seed=seed, steps=steps, out_dir=str(out) if out else None)
    trainer = Trainer(cfg).setup()
    if resume and trainer.resume():
        typer.echo(f"resumed from step {trainer.step}")
    trainer.train()
    if trainer.fmt.generative:  # free-form answers are measured as served, after export (vLLM, as the gateway)
        from training.free_form_eval import measure_artifact

        path = trainer.export({}, merged=merged)
        split = trainer.split
        tests = {f"{prefix}/{label}": qs for role, prefix in (("test_in_domain", "in_domain"),
                                                              ("test_out_of_domain", "out_of_domain"))
                 for label, qs in split.sources[role].items()}
        held_out = [q for role in ("calibration", "test_in_domain", "test_out_of_domain") for q in split.role(role)]
        metrics = measure_artifact(_offline_engines(), path, trainer.resolved.path, tests, held_out)
    else:
        metrics = trainer.evaluate()
        path = trainer.export(metrics, merged=merged)
    for name, m in metrics.items():
        typer.echo(f"{name:40s} acc {m['accuracy']:.3f}  ECE-10 {m['ece_10']:.3f}  AUROC {m['auroc']:.3f}")
    typer.echo(f"artifact: {path}")


@app.command("report")
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
    import torch

    from adapters.hosting.cpu_limits import process_threads
    from training.config import load_config

    if task not in ("multiple-choice", "open-ended"):
        raise typer.BadParameter(f"--task must be multiple-choice or open-ended, not {task!r}")
    open_ended = task == "open-ended"
    torch.set_num_threads(process_threads())
    base = load_config(config or Path("configs/train/open.toml" if open_ended else "configs/train/calm.toml"))
    steps = steps or (max(base.steps // 4, 10) if quick else None)
    out = out or Path("reports/open-ended" if open_ended else "reports/calm")
    if open_ended:
        from training.open_report import run_open_report

        run_open_report(_offline_engines(), base, seeds[:1] if quick else list(seeds), out, steps,
                        4 if quick else samples, limit=50 if quick else None)
        typer.echo((out / "report.md").read_text())
        typer.echo(f"wrote {out}/report.json, report.md, reliability-*.png")
        return
    from training.report import run_report

    summary = run_report(base, seeds[:1] if quick else list(seeds), out, steps, only)
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

    from calm_cli.serving import build_gateway
    from calm_core.startup import StartupLog, stage
    from gateway.edge.http_server import server_config
    from gateway.edge.starting import StartingApp

    progress = StartupLog().install()
    given = {"host": host, "port": port, "artifact": str(artifact) if artifact else None}
    settings = gateway_settings(**{k: v for k, v in given.items() if v is not None})
    url = f"http://{settings.host}:{settings.port}"
    typer.echo(f"CALM Gateway on {url}  (model {settings.served_model_name}, engine {settings.engine.value}); "
               "/health/live answers now, /health/ready and /v1/* once the engines have started")
    # The server listens at once; the app (model conversion on a first run, merged weights) and its engines are built
    # behind it (gateway/edge/starting.py), which answers 503 "starting" meanwhile.
    starting = StartingApp(lambda: build_gateway(settings), doing=lambda: f"{progress.current} ({progress.elapsed():.0f} s)")
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

    settings = gateway_settings(**({"artifact": str(artifact)} if artifact else {}))
    argv, env, allocator = engine_server_command(settings, host, port)
    typer.echo(allocator)
    typer.echo("exec " + " ".join(argv))
    os.execve(argv[0], argv, env)


# -- the retraining loop ------------------------------------------------------------------------------------------------
@app.command("worker")
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
    import logging

    from calm_core.db import Database
    from training.retrain.worker import Worker
    from training.retrain.gate import load_loop_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = gateway_settings()
    # Free-form modes are judged as served: vLLM in process, one engine per artifact scored.
    runner = Worker(load_loop_config(config), Database(settings.database), settings.registry_root, name, lease_s,
                    settings.model, launcher, engines=_offline_engines(settings), registry_url=settings.registry_url)
    typer.echo(f"calm worker {runner.name}: jobs from {settings.database}")
    runner.run(once=once)


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
