"""Building artifacts from a model: references to the base model and tokenizer, reference confidence histograms,
identity heads (the same serving path without calibration)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from calm_core.alpha_head import AlphaHead
from calm_core.artifact import ArtifactManifest, BaseModelRef, DataRef, ReferenceHistogram, TokenizerRef, save_artifact
from calm_core.data import MC_DATASETS, MCQuestion, default_split, load_mc, serving_domain
from calm_core.hashing import sha256_file, vocab_sha256
from calm_core.metrics import calibration_report, confidence_histogram, top_label
from calm_core.models import ResolvedModel, model_weights_sha256, resolve_model
from calm_core.paths import BUNDLED_DATA_DIR
from training.artifact_scoring import option_probabilities
from training.scoring import load_causal_lm, load_tokenizer, output_vocab_size

REFERENCE_BINS = 10  # coarse enough that a 100-answer live window is not mostly sampling noise


def model_refs(resolved: ResolvedModel, tokenizer, vocab_size: int) -> tuple[BaseModelRef, TokenizerRef]:
    return (
        BaseModelRef(id=resolved.id, weights_sha256=model_weights_sha256(resolved)),
        TokenizerRef(sha256=vocab_sha256(tokenizer.get_vocab()), vocab_size=vocab_size),
    )


def reference_questions(root: Path = BUNDLED_DATA_DIR) -> list[MCQuestion]:
    """Held-out questions for reference histograms: the bundled subset, so any machine can rebuild them."""
    return [q for name in MC_DATASETS for q in load_mc(name, default_split(name), root)]


def domain_groups(questions: list[MCQuestion]) -> dict[str, np.ndarray]:
    """Row indices per serving domain, plus 'all': how reference histograms and metrics are grouped."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, q in enumerate(questions):
        groups[serving_domain(q)].append(i)
    groups["all"] = list(range(len(questions)))
    return {d: np.asarray(idx) for d, idx in sorted(groups.items())}


def reference_histogram(confidence: np.ndarray) -> ReferenceHistogram:
    edges, counts = confidence_histogram(confidence, REFERENCE_BINS)
    return ReferenceHistogram(bin_edges=edges, counts=counts)


def reference_statistics(model, tokenizer, questions: list[MCQuestion], head: AlphaHead | None, batch_size: int = 16):
    """Per serving domain (and 'all'): the histogram of calibrated top-label confidences, and the metrics (letter
    format: what identity and hand-made heads serve)."""
    probs = option_probabilities(model, tokenizer, questions, "letter", head, batch_size)
    labels = np.asarray([q.answer for q in questions])
    n_options = np.asarray([q.n_options for q in questions])
    confidence, _ = top_label(probs, labels)
    histograms, metrics = {}, {}
    for domain, idx in domain_groups(questions).items():
        histograms[domain] = reference_histogram(confidence[idx])
        width = int(n_options[idx].max())
        report = calibration_report(probs[idx][:, :width], labels[idx], n_boot=1)
        metrics[domain] = {k: float(v) for k, v in report.as_dict().items() if not isinstance(v, (tuple, list))}
    return histograms, metrics


def write_identity_artifact(out: str | Path, model: str | None = None, with_reference: bool = True) -> ArtifactManifest:
    resolved = resolve_model(model)
    tokenizer = load_tokenizer(resolved.path)
    vocab = output_vocab_size(resolved.path)
    base, tok = model_refs(resolved, tokenizer, vocab)
    head = AlphaHead.identity(vocab)
    histograms, metrics, data = {}, {}, []
    if with_reference:
        questions = reference_questions()
        histograms, metrics = reference_statistics(load_causal_lm(resolved.path), tokenizer, questions, head)
        data = [DataRef(name=f"reference:{p.parent.name}/{p.name}", sha256=sha256_file(p))
                for p in sorted(BUNDLED_DATA_DIR.glob("*/*.jsonl"))]
    return save_artifact(out, head, base_model=base, tokenizer=tok, method="identity", training_data=data,
                         metrics=metrics, reference_histograms=histograms)
