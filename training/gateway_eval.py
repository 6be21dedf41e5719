"""`calm eval --gateway URL`: evaluate a running gateway through the official `openai` client, the way an application
sees it, and write the same report as offline evaluation.

Each question is one chat request with its options (`extra_body.options`), greedy, without the raw-model pass; the
option probabilities come from the response's `calibration.options`. Requests run with bounded concurrency; every
answer is appended to `answers_<set>.jsonl` in the report folder as it arrives, so an interrupted run resumes where
it stopped (answers are keyed by question id and by the gateway's model and artifact version: a run against another
deployment starts over).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from calm_core.data import MCQuestion
from calm_core.errors import CalmError
from training.evaluate import DatasetSpec, question_sets, write_report


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


def _client(cfg: GatewayEvalConfig):
    import openai

    base = cfg.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    return openai.OpenAI(base_url=base, api_key=cfg.api_key, timeout=cfg.timeout_s, max_retries=2)


def ask(client, model: str, q: MCQuestion) -> dict:
    """One question through the gateway: its calibrated option probabilities and the served artifact's version."""
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": q.question}], temperature=0, max_tokens=1,
        extra_body={"options": list(q.choices), "calm": {"raw_confidence": False}},
    )
    calibration = (r.choices[0].model_extra or {}).get("calibration")
    if not calibration or calibration.get("mode") != "multiple_choice":
        raise CalmError(f"the gateway did not answer question {q.id!r} as multiple choice (no calibration options)")
    return {"id": q.id, "probs": [o["probability"] for o in calibration["options"]],
            "artifact_version": calibration["artifact_version"]}


def _load_partial(path: Path, deployment: str) -> dict[str, list[float]]:
    done = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interruption
            if row.get("deployment") == deployment:
                done[row["id"]] = row["probs"]
    return done


def run_gateway_eval(cfg: GatewayEvalConfig, show_progress: bool = True) -> dict:
    import openai

    sets = question_sets(cfg.datasets, cfg.limit, cfg.seed)
    client = _client(cfg)
    try:
        model = cfg.model or client.models.list().data[0].id
        probe = ask(client, model, next(iter(sets.values()))[0])
    except openai.APIConnectionError as e:
        raise CalmError(f"cannot reach the gateway at {cfg.url}: {e}") from None
    except openai.APIStatusError as e:
        raise CalmError(f"the gateway at {cfg.url} answered {e.status_code}: {e.message}") from None
    deployment = f"{model}|{probe['artifact_version']}"
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    probs: dict[str, np.ndarray] = {}
    lock = threading.Lock()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  disable=not show_progress, transient=True) as bar, \
            ThreadPoolExecutor(max_workers=cfg.concurrency) as pool:
        for label, questions in sets.items():
            path = out / f"answers_{label.replace(':', '_')}.jsonl"
            done = _load_partial(path, deployment)
            todo = [q for q in questions if q.id not in done]
            task = bar.add_task(label, total=len(questions), completed=len(questions) - len(todo))
            with path.open("a") as log:
                futures = [pool.submit(ask, client, model, q) for q in todo]
                for future in as_completed(futures):
                    answer = future.result()
                    with lock:
                        log.write(json.dumps({**answer, "deployment": deployment}) + "\n")
                        log.flush()
                    done[answer["id"]] = answer["probs"]
                    bar.advance(task)
            width = max(q.n_options for q in questions)
            probs[label] = np.array([done[q.id] + [0.0] * (width - len(done[q.id])) for q in questions])
    source = {"model": model, "model_weights_sha256": None, "artifact": probe["artifact_version"],
              "answer_format": "the gateway's", "scored_by": f"through the gateway at {cfg.url}"}
    config = {**asdict(cfg), "datasets": [s.label for s in cfg.datasets], "api_key": None}
    return write_report(out, source, config, sets, probs, cfg.n_boot, cfg.seed)
