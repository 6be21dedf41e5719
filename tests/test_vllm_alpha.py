"""The α-head logits processor with vLLM's own batch-update types: requests added, removed, moved and swapped,
with and without opt-out, every row checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from adapters.vllm_plugins.alpha import AlphaHeadLogitsProcessor
from calm_core.alpha_head import AlphaHead
from calm_core.artifact import BaseModelRef, TokenizerRef, save_artifact

V = 16


@pytest.fixture
def processor(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    head = AlphaHead(np.exp(rng.normal(size=V) * 0.5), rng.normal(size=V))
    save_artifact(tmp_path / "a", head, base_model=BaseModelRef(id="t", weights_sha256="w"),
                  tokenizer=TokenizerRef(sha256="t", vocab_size=V), method="test")
    monkeypatch.setenv("CALM_ARTIFACT", str(tmp_path / "a"))
    return AlphaHeadLogitsProcessor(None, torch.device("cpu"), False), head


def params(calibrated=True):
    return SamplingParams(extra_args=None if calibrated else {"calm_alpha": False})


def check(proc, head, calibrated_rows):
    logits = torch.randn(len(calibrated_rows), V)
    out = proc.apply(logits.clone())
    for row, calibrated in enumerate(calibrated_rows):
        want = logits[row] * torch.tensor(head.scale) + torch.tensor(head.shift) if calibrated else logits[row]
        torch.testing.assert_close(out[row], want)


def test_batch_updates_track_opt_outs(processor):
    proc, head = processor
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                  added=[(0, params(), None, []), (1, params(False), None, []), (2, params(), None, [])]))
    check(proc, head, [True, False, True])
    proc.update_state(None)  # no change in batch make-up
    check(proc, head, [True, False, True])
    # Swap rows 1 and 2: the opted-out request now sits in row 2.
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(1, 2, MoveDirectionality.SWAP)]))
    check(proc, head, [True, True, False])
    # Request in row 0 finishes; the one in row 2 moves into its place (one-way).
    proc.update_state(BatchUpdate(batch_size=2, removed=[0], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    check(proc, head, [False, True])
    # A new calibrated request takes row 0, replacing the opted-out one.
    proc.update_state(BatchUpdate(batch_size=2, removed=[0], added=[(0, params(), None, [])], moved=[]))
    check(proc, head, [True, True])


def test_http_style_opt_out_values_and_validation(processor):
    from adapters.vllm_plugins.alpha_heads import wants_alpha

    assert not wants_alpha(SamplingParams(extra_args={"calm_alpha": 0}))
    assert not wants_alpha(SamplingParams(extra_args={"calm_alpha": "false"}))
    assert wants_alpha(SamplingParams(extra_args={"other": 1}))
    with pytest.raises(ValueError, match="must be a boolean"):
        AlphaHeadLogitsProcessor.validate_params(SamplingParams(extra_args={"calm_alpha": "maybe"}))


def test_without_an_artifact_the_plugin_changes_nothing(tmp_path, monkeypatch):
    """Installed as a vLLM plugin, the processor is built for every engine in the environment: one with no CALM
    artifact configured gets its logits back unchanged."""
    monkeypatch.delenv("CALM_ARTIFACT", raising=False)
    proc = AlphaHeadLogitsProcessor(None, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[(0, params(), None, []),
                                                                            (1, params(False), None, [])]))
    logits = torch.randn(2, V)
    torch.testing.assert_close(proc.apply(logits.clone()), logits)


def test_built_twice_for_one_engine_the_second_instance_stands_aside(tmp_path, monkeypatch):
    """The plugin entry point and an explicit --logits-processors both name the class: vLLM builds two instances for
    the same engine config, and the head must be applied once."""
    from types import SimpleNamespace

    rng = np.random.default_rng(2)
    head = AlphaHead(np.exp(rng.normal(size=V) * 0.5), rng.normal(size=V))
    save_artifact(tmp_path / "a", head, base_model=BaseModelRef(id="t", weights_sha256="w"),
                  tokenizer=TokenizerRef(sha256="t", vocab_size=V), method="test")
    config = SimpleNamespace(additional_config={"calm_artifact": str(tmp_path / "a")},
                             model_config=SimpleNamespace(get_vocab_size=lambda: V))
    first, second = (AlphaHeadLogitsProcessor(config, torch.device("cpu"), False) for _ in range(2))
    assert first.active and not second.active and second.is_argmax_invariant()
    logits = torch.randn(3, V)
    out = second.apply(first.apply(logits.clone()))
    torch.testing.assert_close(out, logits * torch.tensor(head.scale) + torch.tensor(head.shift))


def test_requests_may_name_another_artifacts_head_and_keep_it_through_moves(processor, tmp_path, monkeypatch):
    """One engine, several artifact versions: each request's row gets the head it names, the engine's own head, or
    none, and keeps it when vLLM moves rows around."""
    proc, head = processor
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(tmp_path))
    rng = np.random.default_rng(1)
    other = AlphaHead(np.exp(rng.normal(size=V) * 0.5), rng.normal(size=V))
    save_artifact(tmp_path / "b", other, base_model=BaseModelRef(id="t", weights_sha256="w"),
                  tokenizer=TokenizerRef(sha256="t", vocab_size=V), method="test")
    named = SamplingParams(extra_args={"calm_head": "b"})  # a version in the registry folder, by name
    AlphaHeadLogitsProcessor.validate_params(named)

    def check3(kinds):
        logits = torch.randn(len(kinds), V)
        out = proc.apply(logits.clone())
        for row, kind in enumerate(kinds):
            h = {"own": head, "other": other}.get(kind)
            want = logits[row] if h is None else logits[row] * torch.tensor(h.scale) + torch.tensor(h.shift)
            torch.testing.assert_close(out[row], want)

    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                  added=[(0, named, None, []), (1, params(), None, []), (2, params(False), None, [])]))
    check3(["other", "own", "raw"])
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    check3(["raw", "own", "other"])
    proc.update_state(BatchUpdate(batch_size=2, removed=[0], added=[], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    check3(["other", "own"])
    # A batch on one named head (a gateway's: every request names its version) takes the one-pass path.
    # (A slot refilled is only in `added`: vLLM drops it from `removed`.)
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[(1, named, None, [])], moved=[]))
    check3(["other", "other"])
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(0, params(False), None, []), (1, params(False), None, [])]))
    check3(["raw", "raw"])


@pytest.mark.parametrize("name", ["/etc", "../a", "a/../b", "", ".hidden", "b/", 7, "x" * 200, "nope"])
def test_a_request_names_a_version_in_the_registry_never_a_path(tmp_path, monkeypatch, name):
    """Whoever reaches an engine can name a head, so a name is resolved only inside the registry folder."""
    save_artifact(tmp_path / "registry" / "b", AlphaHead(np.ones(V), np.zeros(V)), method="test",
                  base_model=BaseModelRef(id="t", weights_sha256="w"), tokenizer=TokenizerRef(sha256="t", vocab_size=V))
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(tmp_path / "registry"))
    AlphaHeadLogitsProcessor.validate_params(SamplingParams(extra_args={"calm_head": "b"}))
    with pytest.raises(ValueError, match="calm_head"):
        AlphaHeadLogitsProcessor.validate_params(SamplingParams(extra_args={"calm_head": name}))


def test_a_version_whose_head_does_not_match_its_hash_is_refused(tmp_path, monkeypatch):
    from calm_core.artifact import load_artifact

    save_artifact(tmp_path / "c", AlphaHead(np.ones(V), np.zeros(V)), method="test",
                  base_model=BaseModelRef(id="t", weights_sha256="w"), tokenizer=TokenizerRef(sha256="t", vocab_size=V))
    head_file = tmp_path / "c" / "alpha_head.safetensors"
    head_file.write_bytes(head_file.read_bytes()[:-4] + b"\0\0\0\1")
    with pytest.raises(Exception):
        load_artifact(tmp_path / "c")
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="does not load"):
        AlphaHeadLogitsProcessor.validate_params(SamplingParams(extra_args={"calm_head": "c"}))
