"""The embedded default model: conversion from the GGUF in the wheel, equivalence, and the cache's idempotence."""

from __future__ import annotations

import numpy as np
import pytest

from calm_core.data import load_mc
from calm_core.models import embedded_gguf_path, load_gguf_model, prepare_embedded, read_model_manifest, resolve_model
from calm_core.hashing import sha256_file
from training.artifact_scoring import option_probabilities

pytestmark = pytest.mark.slow


def test_conversion_manifest_and_idempotence(embedded_model_dir):
    manifest = read_model_manifest(embedded_model_dir)
    assert manifest["source_sha256"] == sha256_file(embedded_gguf_path())
    assert manifest["dtype"] == "float32"
    mtime = (embedded_model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_embedded("float32") == embedded_model_dir  # second call reuses the cache
    assert (embedded_model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert resolve_model("embedded").path == str(embedded_model_dir)
    assert resolve_model(str(embedded_model_dir)).local


def test_converted_folder_matches_gguf_letter_logprobs(embedded_model, shared_data):
    """Same answer-letter log-probs from the safetensors folder as from the GGUF itself (fp32, 1e-4)."""
    questions = load_mc("arc_easy", "dev", root=shared_data)[:12] + load_mc("commonsenseqa", root=shared_data)[:4]
    model, tokenizer = embedded_model
    gguf_model, gguf_tokenizer = load_gguf_model(embedded_gguf_path(), "float32")
    gguf_model.eval()
    converted = option_probabilities(model, tokenizer, questions, "letter", None)
    original = option_probabilities(gguf_model, gguf_tokenizer, questions, "letter", None)
    with np.errstate(divide="ignore"):  # padded options have probability 0
        lp_conv = np.log(converted)
        lp_orig = np.log(original)
    finite = np.isfinite(lp_orig)
    assert np.array_equal(finite, np.isfinite(lp_conv))
    np.testing.assert_allclose(lp_conv[finite], lp_orig[finite], atol=1e-4)
    # Not vacuous: the model does distinguish the options.
    assert np.ptp(lp_conv[:12, :4], axis=1).max() > 0.5
