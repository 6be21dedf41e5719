"""Score multiple-choice questions offline exactly as the gateway serves an artifact: the base weights with the
artifact's LoRA adapter merged in, the artifact's answer format (letter or cloze) and its α head, through the
gateway's scorers (calm_core/scorers/) on the offline engine (training/offline_engine.py).

Training, `calm eval`, the reports and the retraining gate score by this one path; a test checks it against the
gateway's answers to the same questions.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from calm_core.alpha_head import AlphaHead
from calm_core.artifact import LoadedArtifact, load_artifact
from calm_core.data import MCQuestion
from calm_core.hashing import vocab_sha256
from calm_core.prompts import AnswerFormat
from calm_core.scorers.base import PostHoc, ScoredChoice
from calm_core.scorers.questions import option_matrix, score_options
from training.frozen_states import FrozenStates
from training.offline_engine import ForwardMemo, OfflineEngine
from training.scoring import load_causal_lm, load_tokenizer, output_vocab_size

# Questions per memo where versions share one: a memo holds its questions' logits (~0.2 MB per scored position: ~8 MB
# for a four-option question of a few tokens each) until every sharer has read them. The offline engine's batch: as
# many forward passes as without chunks.
SHARED_CHUNK = 8


def load_verified_artifact(path: str | Path, model_path: str, tokenizer) -> LoadedArtifact:
    """The artifact, refused with a one-line error unless it fits this model's vocabulary and tokenizer (checked
    before any weights load: a mismatch should fail in a second, not a minute)."""
    return load_artifact(path, expect_vocab_size=output_vocab_size(model_path),
                         expect_tokenizer_sha256=vocab_sha256(tokenizer.get_vocab()))


def load_served_model(model_path: str, adapter_dir: Path | None, dtype: str = "float32"):
    """The model the gateway runs for multiple choice: base weights, plus the artifact's adapter merged if it has one."""
    model = load_causal_lm(model_path, dtype)
    if adapter_dir is None:
        return model
    from peft import PeftModel  # heavy, and needed only for artifacts that carry an adapter

    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()


# PEFT config fields that are sets written as lists (layer_replication, for one, is ordered).
UNORDERED_LORA_FIELDS = ("target_modules", "modules_to_save", "layers_to_transform", "exclude_modules")


def same_weights(a: LoadedArtifact, b: LoadedArtifact) -> bool:
    """Whether two versions serve the same weights and differ by their heads (and post-hoc maps) alone, as a head-only
    candidate (CALM with θ held) and its parent do: neither has an adapter, or their adapters' shapes and tensors are
    equal (compared as tensors: the files may have been written apart)."""
    if a.adapter_dir is None or b.adapter_dir is None:
        return a.adapter_dir is None and b.adapter_dir is None
    from safetensors.torch import load_file

    def shape(artifact: LoadedArtifact) -> dict:
        config = json.loads((artifact.adapter_dir / "adapter_config.json").read_text())
        # Where the base model was read from does not change the weights; PEFT writes its sets of modules and layers
        # in any order (the loop's head-only candidates list their parent's target modules in another).
        return {k: sorted(v, key=str) if k in UNORDERED_LORA_FIELDS and isinstance(v, list) else v
                for k, v in config.items() if k not in ("base_model_name_or_path", "revision")}

    if shape(a) != shape(b):
        return False
    ta, tb = (load_file(str(x.adapter_dir / "adapter_model.safetensors")) for x in (a, b))
    return ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)


def served_probabilities(versions: list[LoadedArtifact], model_path: str, *question_sets: list[MCQuestion],
                         frozen: FrozenStates | None = None) -> list[list[np.ndarray]]:
    """Each version's option probabilities on each set, scored as the gateway serves it. Versions with the same
    weights (same_weights) share one load of the model and one forward pass per question: only their heads differ.
    `frozen`: states of a frozen bottom (the trainer's, of the questions it encoded); each version whose weights share
    that bottom runs its top layers from them, and adds the questions' states it lacked for the next version."""
    tokenizer = load_tokenizer(model_path)
    out: list[list[np.ndarray]] = [[] for _ in versions]
    done: set[int] = set()
    for n, version in enumerate(versions):
        if n in done:
            continue
        sharing = [n] + [m for m in range(n + 1, len(versions)) if m not in done and same_weights(version, versions[m])]
        done.update(sharing)
        model = load_served_model(model_path, version.adapter_dir)
        bottom = frozen if frozen is not None and frozen.serve(model) else None
        for qs in question_sets:
            scored: dict[int, list[ScoredChoice]] = {m: [] for m in sharing}
            # Sharers go through a chunk at a time, a memo per chunk: it holds the chunk's logits until the last
            # sharer has read them (SHARED_CHUNK).
            step = SHARED_CHUNK if len(sharing) > 1 else max(len(qs), 1)
            for chunk in (qs[i : i + step] for i in range(0, len(qs), step)):
                memo = {} if len(sharing) > 1 else None
                for m in sharing:
                    manifest = versions[m].manifest
                    scored[m] += scored_choices(model, tokenizer, chunk, manifest.answer_format, versions[m].head,
                                                option_temperature=manifest.option_temperature, memo=memo, frozen=bottom)
            for m in sharing:
                out[m].append(option_matrix(scored[m]) if qs else np.zeros((0, 0)))
        del model
    return out


def option_probabilities(model, tokenizer, questions: list[MCQuestion], format_name: AnswerFormat,
                         head: AlphaHead | None, batch_size: int = 8,
                         progress: Callable[[int], None] | None = None, option_temperature: float = 1.0,
                         memo: ForwardMemo | None = None, frozen: FrozenStates | None = None) -> np.ndarray:
    """(N, max options) each question's distribution over its options (padding columns 0), through the α head and a
    recalibrated version's option temperature. `memo`, `frozen`: shared by engines over this model, or over models
    with this frozen bottom (OfflineEngine)."""
    return option_matrix(scored_choices(model, tokenizer, questions, format_name, head, batch_size, progress,
                                        option_temperature, memo, frozen))


def scored_choices(model, tokenizer, questions: list[MCQuestion], format_name: AnswerFormat, head: AlphaHead | None,
                   batch_size: int = 8, progress: Callable[[int], None] | None = None, option_temperature: float = 1.0,
                   memo: ForwardMemo | None = None, frozen: FrozenStates | None = None) -> list[ScoredChoice]:
    """option_probabilities' answers before they become a matrix."""
    engine = OfflineEngine(model, tokenizer, head, batch_size, memo=memo, frozen=frozen)
    return asyncio.run(score_options(engine, tokenizer, questions, format_name, progress=progress,
                                     post_hoc=PostHoc(option_temperature)))
