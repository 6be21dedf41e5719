"""Building artifacts from a model: references to the base model and tokenizer, identity heads."""

from __future__ import annotations

from pathlib import Path

from calm_core.alpha_head import AlphaHead
from calm_core.artifact import ArtifactManifest, BaseModelRef, TokenizerRef, save_artifact
from calm_core.hashing import vocab_sha256
from calm_core.models import ResolvedModel, model_weights_sha256, resolve_model


def model_refs(resolved: ResolvedModel, tokenizer, vocab_size: int) -> tuple[BaseModelRef, TokenizerRef]:
    return (
        BaseModelRef(id=resolved.id, weights_sha256=model_weights_sha256(resolved)),
        TokenizerRef(sha256=vocab_sha256(tokenizer.get_vocab()), vocab_size=vocab_size),
    )


def output_vocab_size(model_path: str) -> int:
    """Rows of the LM head: what the α head must cover (may exceed len(tokenizer) for padded vocabularies)."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).vocab_size)


def write_identity_artifact(out: str | Path, model: str | None = None) -> ArtifactManifest:
    from transformers import AutoTokenizer

    resolved = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    vocab = output_vocab_size(resolved.path)
    base, tok = model_refs(resolved, tokenizer, vocab)
    return save_artifact(out, AlphaHead.identity(vocab), base_model=base, tokenizer=tok, method="identity")
