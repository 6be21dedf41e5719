"""`calm eval --gateway URL`: evaluate a running gateway through the official `openai` client, the way an application
sees it, and write the same report as offline evaluation.

Each question is one chat request with its options (`extra_body.options`), greedy, without the raw-model pass; the
option probabilities come from the response's `calibration.options`. Requests run with bounded concurrency; every
answer is appended to `answers_<set>.jsonl` in the report folder as it arrives, so an interrupted run resumes where
it stopped (answers are keyed by question id and by the gateway's model and artifact version: a run against another
deployment starts over).

Open-ended sets (TriviaQA, PopQA, or a JSONL with `answers` aliases) are asked without options: the greedy answer of
the serving version's free-form mode, its token confidence (and, with `samples`, a second request for semantic
confidence), correctness by the offline evaluation's alias match, and the offline free-form report.
"""

from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from calm_core.answers import is_correct
from calm_core.data import MCQuestion, OpenQuestion, serving_domain
from calm_core.errors import CalmError
from training.evaluate import DatasetSpec, question_sets, sample_questions, write_report
from training.free_form_eval import MAX_TOKENS, FreeFormRecord, write_free_form_report


@dataclass(frozen=True)
class GatewayEvalConfig:
    url: str  # the gateway's base URL (with or without /v1)
    datasets: tuple[DatasetSpec, ...]
    api_key: str = "unused"
    model: str | None = None  # None: the first model the gateway lists
    limit: int | None = 300
    seed: int = 0
    concurrency: int = 8
    timeout_s: float = 300.0
    out_dir: str = "reports/eval-gateway"
    n_boot: int = 200
    samples: int = 0  # open-ended sets: answers sampled per question for semantic confidence (0: token only)
    # The domain every question is sent in (`metadata.domain`), so the version serving that domain answers; None: each
    # question's own (its file's `domain` column, the dataset's serving domain: medmcqa -> medicine, ...).
    domain: str | None = None


def question_domain(cfg: GatewayEvalConfig, q: MCQuestion | OpenQuestion) -> str:
    return cfg.domain or serving_domain(q)


def _client(cfg: GatewayEvalConfig):
    import openai

    base = cfg.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    return openai.OpenAI(base_url=base, api_key=cfg.api_key, timeout=cfg.timeout_s, max_retries=2)


def ask(client, model: str, q: MCQuestion, domain: str) -> dict:
    """One question through the gateway in `domain`: its calibrated option probabilities and the version that
    served it."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": q.question}], temperature=0, max_tokens=1,
        metadata={"domain": domain}, extra_body={"options": list(q.choices), "calm": {"raw_confidence": False}},
    )
    calibration = (r.choices[0].model_extra or {}).get("calibration")
    if not calibration or calibration.get("mode") != "multiple_choice":
        raise CalmError(f"the gateway did not answer question {q.id!r} as multiple choice (no calibration options)")
    return {"id": q.id, "probs": [o["probability"] for o in calibration["options"]], "domain": domain,
            "artifact_version": calibration["artifact_version"]}


def ask_open(client, model: str, q: OpenQuestion, domain: str, samples: int) -> dict:
    """One open-ended question through the gateway: the greedy answer with its token confidence (and the calibrated
    token log-probs, for the sequence probability); with `samples`, the semantic confidence of the same question."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": q.question}], temperature=0, max_tokens=MAX_TOKENS,
        logprobs=True, metadata={"domain": domain}, extra_body={"calm": {"confidence": "token", "raw_confidence": False}})
    choice = r.choices[0]
    calibration = (choice.model_extra or {}).get("calibration") or {}
    if calibration.get("mode") != "free_form":
        raise CalmError(f"the gateway did not answer question {q.id!r} in free form")
    log_probs = [t.logprob for t in (choice.logprobs.content or [])] if choice.logprobs else []
    row = {"id": q.id, "domain": domain, "text": choice.message.content, "token_confidence": calibration["confidence"],
           "sequence_probability": math.exp(sum(log_probs)), "n_tokens": r.usage.completion_tokens,
           "artifact_version": calibration["artifact_version"]}
    if samples:
        s = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": q.question}], temperature=0, max_tokens=MAX_TOKENS,
            metadata={"domain": domain}, extra_body={"calm": {"confidence": "semantic", "samples": samples, "raw_confidence": True}})
        sem = s.choices[0].model_extra["calibration"]
        row.update(semantic_text=s.choices[0].message.content, semantic_confidence=sem["confidence"],
                   semantic_agreeing=round((sem["raw_confidence"] or 0.0) * samples),
                   cluster_sizes=[c["size"] for c in sem.get("clusters") or []])
    return row


def open_record(q: OpenQuestion, row: dict) -> FreeFormRecord:
    """The offline evaluation's record of a gateway answer (correctness by the same alias match)."""
    record = FreeFormRecord(q.id, serving_domain(q), row["text"], is_correct(row["text"], q.answers, q.question),
                            row["token_confidence"], row["sequence_probability"], row["n_tokens"])
    if row.get("semantic_text") is not None:
        record.semantic_text, record.semantic_confidence = row["semantic_text"], row["semantic_confidence"]
        record.semantic_agreeing, record.cluster_sizes = row["semantic_agreeing"], row["cluster_sizes"]
        record.semantic_correct = is_correct(row["semantic_text"], q.answers, q.question)
    return record


def _load_partial(path: Path, deployment: str) -> dict[str, dict]:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interruption
            if row.get("deployment") == deployment:
                done[row["id"]] = row
    return done


def _answer_all(cfg: GatewayEvalConfig, sets: dict[str, list], ask_one, deployment: str, log_prefix: str,
                show_progress: bool) -> dict[str, dict[str, dict]]:
    """Every question's answer row per set, `cfg.concurrency` in flight, each appended to <log_prefix>_<set>.jsonl as
    it arrives; rows already there for this deployment are not asked again."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    answers, lock = {}, threading.Lock()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not show_progress, transient=True) as bar, \
            ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
        for label, questions in sets.items():
            path = out / f"{log_prefix}_{label.replace(':', '_').replace('@', '_')}.jsonl"
            done = _load_partial(path, deployment)
            todo = [q for q in questions if q.id not in done]
            task = bar.add_task(label, total=len(questions), completed=len(questions) - len(todo))
            futures = [pool.submit(ask_one, q) for q in todo]
            with path.open("a") as log:
                try:
                    for future in as_completed(futures):
                        row = {**future.result(), "deployment": deployment}
                        with lock:
                            log.write(json.dumps(row) + "\n")
                            log.flush()
                        done[row["id"]] = row
                        bar.advance(task)
                except BaseException:  # a refused question or Ctrl-C: the questions not yet asked are not asked
                    for pending in futures:
                        pending.cancel()
                    raise
            answers[label] = done
    return answers


def _refusal(e) -> str:
    """What the gateway said: its OpenAI error message (the client's own adds "Error code: N - {...}")."""
    if getattr(e, "status_code", None) is None:
        return f"could not be reached: {e}"
    said = e.body.get("message") if isinstance(e.body, dict) else None
    return f"answered {e.status_code}: {said or e.message}"


def run_gateway_eval(cfg: GatewayEvalConfig, show_progress: bool = True) -> dict:
    import openai

    open_ended = all(s.open_ended for s in cfg.datasets)
    sets = ({s.label: sample_questions(s.load(), cfg.limit, cfg.seed) for s in cfg.datasets} if open_ended
            else question_sets(cfg.datasets, cfg.limit, cfg.seed))
    client = _client(cfg)
    try:
        model = cfg.model or client.models.list().data[0].id
        first = next(iter(sets.values()))[0]
        asked = partial(ask_open, client, model, samples=cfg.samples) if open_ended else partial(ask, client, model)
        ask_one = lambda q: asked(q, question_domain(cfg, q))  # noqa: E731
        probe = ask_one(first)
    except openai.APIConnectionError as e:
        raise CalmError(f"cannot reach the gateway at {cfg.url}: {e}") from None
    except openai.APIStatusError as e:
        raise CalmError(f"the gateway at {cfg.url} {_refusal(e)}") from None
    deployment = f"{model}|{probe['artifact_version']}|samples={cfg.samples if open_ended else 0}|domain={cfg.domain}"
    # Open-ended: the report writes its records to answers_<set>.jsonl; the gateway's rows are kept beside them.
    try:
        answers = _answer_all(cfg, sets, ask_one, deployment, "gateway_answers" if open_ended else "answers",
                              show_progress)
    except (openai.APIConnectionError, openai.APIStatusError) as e:  # after the client's own retries
        raise CalmError(
            f"the gateway at {cfg.url} {_refusal(e)}. The answers so far are kept in {cfg.out_dir}: the same command resumes "
            f"from them. A 503 that says the engine timed out means its queue outgrew the gateway's "
            f"CALM_UPSTREAM_TIMEOUT_S: ask fewer at a time (--concurrency, {cfg.concurrency} now)") from None
    scored_by = f"through the gateway at {cfg.url}"
    # The versions that answered, per domain asked in (a domain with a version of its own is served by it).
    versions = sorted({(row["domain"], row["artifact_version"]) for rows in answers.values() for row in rows.values()
                       if "domain" in row})
    artifact = (versions[0][1] if len({v for _, v in versions}) == 1 else ", ".join(f"{v} ({d})" for d, v in versions)
                ) if versions else probe["artifact_version"]
    if open_ended:
        per_set = {label: [open_record(q, answers[label][q.id]) for q in qs] for label, qs in sets.items()}
        return write_free_form_report(Path(cfg.out_dir), per_set, {
            "model": model, "artifact": artifact, "answer_format": "generative",
            "samples": cfg.samples, "limit": cfg.limit, "seed": cfg.seed, "scored_by": scored_by})
    probs = {}
    for label, questions in sets.items():
        width = max(q.n_options for q in questions)
        rows = answers[label]
        probs[label] = np.array([rows[q.id]["probs"] + [0.0] * (width - len(rows[q.id]["probs"])) for q in questions])
    source = {"model": model, "model_weights_sha256": None, "artifact": artifact,
              "answer_format": "the gateway's", "scored_by": scored_by}
    config = {**asdict(cfg), "datasets": [s.label for s in cfg.datasets], "api_key": None}
    return write_report(Path(cfg.out_dir), source, config, sets, probs, cfg.n_boot, cfg.seed)
