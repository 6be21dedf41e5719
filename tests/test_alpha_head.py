"""α-head math and the artifact format: round trip, atomic writes, and refusal of mismatches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calm_core.alpha_head import AlphaHead, HeadKind, apply_alpha
from calm_core.scoring import log_softmax_np, option_probs
from calm_core.artifact import BaseModelRef, ReferenceHistogram, TokenizerRef, load_artifact, save_artifact
from calm_core.errors import ArtifactError

V = 32
BASE = BaseModelRef(id="tiny", weights_sha256="w" * 64)
TOK = TokenizerRef(sha256="t" * 64, vocab_size=V)


def vector_head(seed=0) -> AlphaHead:
    rng = np.random.default_rng(seed)
    return AlphaHead(np.exp(rng.normal(size=V) * 0.3), rng.normal(size=V))


def test_apply_matches_formula_numpy_and_torch():
    head = vector_head()
    z = np.random.default_rng(1).normal(size=(3, V)).astype(np.float32)
    expected = z * head.scale[None] + head.shift[None]
    np.testing.assert_allclose(apply_alpha(z, head.scale, head.shift), expected, rtol=1e-6)
    got = apply_alpha(torch.tensor(z), torch.tensor(head.scale), torch.tensor(head.shift)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_scalar_head_is_temperature_scaling():
    head = AlphaHead.scalar(temperature=2.0)
    assert head.kind is HeadKind.SCALAR
    z = np.array([[2.0, 0.0, -1.0]])
    d, l = head.rows([5, 7, 9])
    np.testing.assert_allclose(option_probs(apply_alpha(z, d, l)), np.exp(log_softmax_np(z / 2.0)), rtol=1e-12)


def test_identity_head_changes_nothing():
    head = AlphaHead.identity(V)
    z = np.random.default_rng(2).normal(size=(4, V))
    np.testing.assert_array_equal(apply_alpha(z, head.scale, head.shift), z)


def test_option_probs_masks_padding():
    logits = np.array([[1.0, 2.0, 3.0, 9.0], [0.0, 0.0, 0.0, 0.0]])
    probs = option_probs(logits, np.array([3, 4]))
    assert probs[0, 3] == 0.0
    np.testing.assert_allclose(probs.sum(1), 1.0)
    np.testing.assert_allclose(probs[0, :3], np.exp(log_softmax_np(logits[0, :3])))
    np.testing.assert_allclose(probs[1], 0.25)


@pytest.mark.parametrize(
    "scale, shift, message",
    [
        (np.ones(4), np.zeros(3), "equal shape"),
        (np.array([1.0, 0.0]), np.zeros(2), "`scale` > 0"),
        (np.array([1.0, np.nan]), np.zeros(2), "finite"),
    ],
)
def test_invalid_heads_are_refused(scale, shift, message):
    with pytest.raises(ValueError, match=message):
        AlphaHead(scale, shift)


def test_artifact_round_trip(tmp_path):
    head = vector_head()
    hist = {"science": ReferenceHistogram(bin_edges=list(np.linspace(0, 1, 5)), counts=[1, 2, 3, 4])}
    manifest = save_artifact(
        tmp_path / "a", head, base_model=BASE, tokenizer=TOK, method="calm",
        metrics={"arc_easy": {"ece_10": 0.05}}, reference_histograms=hist,
    )
    loaded = load_artifact(tmp_path / "a", expect_vocab_size=V, expect_tokenizer_sha256=TOK.sha256,
                           expect_weights_sha256=BASE.weights_sha256)
    np.testing.assert_array_equal(loaded.head.scale, head.scale)
    np.testing.assert_array_equal(loaded.head.shift, head.shift)
    assert loaded.manifest.artifact_version == manifest.artifact_version
    assert loaded.manifest.artifact_version.startswith("calm-")
    assert loaded.manifest.reference_histograms["science"].counts == [1, 2, 3, 4]
    assert loaded.manifest.metrics["arc_easy"]["ece_10"] == 0.05
    assert loaded.adapter_dir is None


def test_overwrite_is_atomic_and_leaves_no_temporaries(tmp_path):
    save_artifact(tmp_path / "a", vector_head(0), base_model=BASE, tokenizer=TOK, method="calm", artifact_version="v1")
    save_artifact(tmp_path / "a", vector_head(1), base_model=BASE, tokenizer=TOK, method="calm", artifact_version="v2")
    assert load_artifact(tmp_path / "a").manifest.artifact_version == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_failed_write_keeps_the_old_artifact(tmp_path):
    save_artifact(tmp_path / "a", vector_head(0), base_model=BASE, tokenizer=TOK, method="calm", artifact_version="v1")
    with pytest.raises(FileNotFoundError):
        save_artifact(tmp_path / "a", vector_head(1), base_model=BASE, tokenizer=TOK, method="calm",
                      adapter_dir=tmp_path / "no-such-adapter")
    assert load_artifact(tmp_path / "a").manifest.artifact_version == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_save_refuses_head_of_wrong_size(tmp_path):
    with pytest.raises(ValueError, match="vocabulary has 32"):
        save_artifact(tmp_path / "a", AlphaHead.identity(V + 1), base_model=BASE, tokenizer=TOK, method="x")


@pytest.fixture
def saved(tmp_path):
    save_artifact(tmp_path / "a", vector_head(), base_model=BASE, tokenizer=TOK, method="calm")
    return tmp_path / "a"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"expect_vocab_size": V + 5}, "covers 32 tokens but the model's vocabulary has 37"),
        ({"expect_tokenizer_sha256": "x" * 64}, "different tokenizer"),
        ({"expect_weights_sha256": "x" * 64}, "other weights"),
    ],
)
def test_mismatches_are_refused(saved, kwargs, message):
    with pytest.raises(ArtifactError, match=message):
        load_artifact(saved, **kwargs)


def test_corrupt_or_incomplete_artifacts_are_refused(saved, tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_artifact(tmp_path / "nowhere")
    data = bytearray((saved / "alpha_head.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (saved / "alpha_head.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="do not match the hash"):
        load_artifact(saved)
    manifest = json.loads((saved / "manifest.json").read_text())
    del manifest["tokenizer"]
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="invalid manifest \\(tokenizer"):
        load_artifact(saved)


def test_one_artifact_for_every_request_carries_its_free_form_mode(tmp_path):
    """A multiple-choice artifact with a free-form one attached: a new version, both heads verified at load, the
    free-form domains' reference histograms joined, and an edited or foreign free-form part refused."""
    from calm_core.artifact import FREE_FORM_DIR, attach_free_form, update_manifest

    hist = lambda n: ReferenceHistogram(bin_edges=[0.0, 0.5, 1.0], counts=[n, 1])  # noqa: E731
    mc = save_artifact(tmp_path / "mc", AlphaHead.scalar(2.0), base_model=BASE, tokenizer=TOK, method="calm_scalar",
                       answer_format="cloze", applies_to="multiple_choice",
                       reference_histograms={"science": hist(1), "all": hist(2)})
    ff = save_artifact(tmp_path / "ff", vector_head(), base_model=BASE, tokenizer=TOK, method="calm",
                       answer_format="generative", applies_to="free_form",
                       reference_histograms={"trivia": hist(3), "all": hist(4)})
    with pytest.raises(ArtifactError, match="attach a free-form"):
        attach_free_form(tmp_path / "ff", tmp_path / "mc", tmp_path / "bad")
    both = attach_free_form(tmp_path / "mc", tmp_path / "ff", tmp_path / "both")
    assert both.artifact_version != mc.artifact_version and both.free_form_version == ff.artifact_version
    assert both.reference_histograms["all"].counts == [2, 1] and both.reference_histograms["trivia"].counts == [3, 1]
    loaded = load_artifact(tmp_path / "both", expect_vocab_size=V)
    assert loaded.head.kind.value == "scalar" and loaded.free_form.head.kind.value == "vector"
    assert loaded.free_form.manifest.answer_format == "generative"
    assert load_artifact(tmp_path / "mc").free_form is None  # multiple choice only: no free-form mode
    assert load_artifact(tmp_path / "ff").free_form.path == tmp_path / "ff"
    # A free-form part that is not the one named, or trained on another model, is refused with the outer artifact.
    update_manifest(tmp_path / "both" / FREE_FORM_DIR, artifact_version="other")
    with pytest.raises(ArtifactError, match="not the free-form artifact"):
        load_artifact(tmp_path / "both")
    update_manifest(tmp_path / "both" / FREE_FORM_DIR, artifact_version=ff.artifact_version,
                    base_model=BaseModelRef(id="other", weights_sha256="0" * 64))
    with pytest.raises(ArtifactError, match="another base model"):
        load_artifact(tmp_path / "both")
