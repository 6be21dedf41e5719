"""Hidden states of the frozen bottom, shared by the models that agree below a layer.

LoRA sits on the top layers only (training/top_layers.py), so the trainer's model, the candidate it exports and their
parent (its adapter on the same top layers) compute the same hidden states for a token sequence up to the first
adapted layer. The retraining gate scores the candidate and its parent on the questions the trainer has just encoded:
with the trainer's states handed over, each version runs only its own top layers (4 of the embedded model's 30).

Whether a model may use the states is decided by its weights, not by what an adapter's config says: a digest of its
embeddings and of every parameter below the layer, equal to the digest of the model that computed them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from training.cloze import PackedQuestion
from training.top_layers import decoder

if TYPE_CHECKING:
    from training.features import EncodedSet

# What the gate scores from them: the captured prompts (calibration) and the domain's test questions. The training set
# is the largest of a trainer's sets and nothing scores it afterwards.
JUDGED_ROLES = ("calibration", "test_in_domain")


# Config fields that do not change a hidden state (where the model was read from, what a forward returns, the library
# that wrote it; dtypes are hashed with the tensors), so a model loaded one way and trained another still matches.
NOT_NUMERIC = {"name_or_path", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
               "transformers_version", "architectures", "torch_dtype", "dtype"}


def bottom_digest(model, layer: int) -> str:
    """sha256 over what the hidden states entering decoder layer `layer` depend on: the token embeddings, every
    parameter and buffer of the layers below it and of the rotary embedding (their names, dtypes and values), and the
    model's config (norm epsilon, rope scaling; NOT_NUMERIC left out)."""
    stack, _ = decoder(model)
    config = {k: v for k, v in stack.config.to_dict().items() if not k.startswith("_") and k not in NOT_NUMERIC}
    h = hashlib.sha256(json.dumps([layer, config], sort_keys=True, default=str).encode())
    modules = [("embed_tokens", stack.embed_tokens), ("rotary_emb", stack.rotary_emb)]
    modules += [(f"layers.{i}", stack.layers[i]) for i in range(layer)]
    for prefix, module in modules:
        tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        for name, tensor in sorted(tensors.items()):
            h.update(f"{prefix}.{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
            h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _parts(question: PackedQuestion) -> tuple[tuple[int, ...], list[tuple[int, ...]], list[slice]]:
    """A packed question's prompt ids, its options' ids in packed order, and the rows of each part (prompt first; the
    parts are contiguous, prompt then options, as training/cloze.py's pack_question lays them out)."""
    ids, segment = question.input_ids.tolist(), question.segment.tolist()
    bounds: dict[int, list[int]] = {0: [0, 0]}  # a prompt, maybe empty
    for row, part in enumerate(segment):
        bounds.setdefault(part, [row, row])[1] = row + 1
    parts = [slice(*bounds[k]) for k in sorted(bounds)]
    return tuple(ids[parts[0]]), [tuple(ids[part]) for part in parts[1:]], parts


def question_key(question: PackedQuestion) -> tuple:
    """A question as the set of token sequences it asks about (the prompt followed by each option). Each option's rows
    see the prompt and themselves, their positions restarting where the prompt ends, so a row's state is the state of
    that position in its sequence: neither the order the options are packed in nor where the prompt is cut (a token
    every option starts with is packed in the prompt by the engine, in each option by training) changes it."""
    prompt, options, _ = _parts(question)
    return tuple(sorted(prompt + option for option in options))


@dataclass
class QuestionStates:
    prompt_ids: tuple[int, ...]
    prompt: torch.Tensor  # (P, H)
    options: dict[tuple[int, ...], torch.Tensor]  # option ids -> (len, H)

    def sequence(self, ids: tuple[int, ...]) -> torch.Tensor:
        """(len(ids), H) the states of one asked sequence (the prompt, then an option)."""
        return torch.cat([self.prompt, self.options[ids[len(self.prompt_ids):]]])


@dataclass
class FrozenStates:
    """States entering decoder layer `layer` per question (question_key), all computed by models whose bottom has
    `digest`. An engine given them adds the states of the questions it computes, for the next model that shares them."""

    layer: int
    digest: str
    dtype: torch.dtype
    states: dict[tuple, QuestionStates] = field(default_factory=dict)

    @classmethod
    def of_model(cls, model, layer: int) -> "FrozenStates":
        """None kept yet: an engine over `model` computes and keeps them."""
        return cls(layer, bottom_digest(model, layer), decoder(model)[0].embed_tokens.weight.dtype)

    @classmethod
    def of_encoded(cls, model, layer: int, questions: Iterable[PackedQuestion]) -> "FrozenStates":
        """The states `model` encoded for `questions` (training/cloze.py's encode_packed, up to `layer`)."""
        frozen = cls.of_model(model, layer)
        for q in questions:
            if q.hidden is not None:
                frozen.add(q, q.hidden)
        return frozen

    @classmethod
    def of_sets(cls, model, layer: int, sets: dict[str, dict[str, EncodedSet]]) -> "FrozenStates | None":
        """The states a trainer encoded (Trainer.sets: per role and source) of the questions the gate scores
        (JUDGED_ROLES); None unless the format packs its questions (cloze; the letter format encodes prompts alone)."""
        items = [q for role in JUDGED_ROLES for data in sets.get(role, {}).values() for q in data.items]
        if not items or not all(isinstance(q, PackedQuestion) for q in items):
            return None
        return cls.of_encoded(model, layer, items)

    def serve(self, model) -> bool:
        """Whether `model` computes these states itself: the same dtype, embeddings and layers below `layer` (the
        dtype first: a bfloat16 trainer's states never serve the float32 gate, and need no hashing to say so)."""
        stack, _ = decoder(model)
        return stack.embed_tokens.weight.dtype == self.dtype and bottom_digest(model, self.layer) == self.digest

    def __contains__(self, question: PackedQuestion) -> bool:
        return question_key(question) in self.states

    def add(self, question: PackedQuestion, hidden: torch.Tensor) -> None:
        """Keep `hidden` ((T, H), `question`'s rows as packed) by part."""
        prompt, options, rows = _parts(question)
        self.states[question_key(question)] = QuestionStates(
            prompt, hidden[rows[0]], {option: hidden[r] for option, r in zip(options, rows[1:])})

    def rows(self, question: PackedQuestion) -> torch.Tensor:
        """(T, H) the states of `question`'s rows as it is packed: its prompt's, then each option's."""
        prompt, options, _ = _parts(question)
        kept = self.states[question_key(question)]
        sequences = [kept.sequence(prompt + option) for option in options]
        return torch.cat([sequences[0][: len(prompt)]] + [states[len(prompt):] for states in sequences])
