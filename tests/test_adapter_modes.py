"""CUDA's default adapter mode, run on the CPU: the artifact's adapter as a vLLM LoRA inside the in-process engine
(`CALM_ADAPTER_MODE=lora`) instead of a merged copy, scored per token. Same numbers as HF transformers + peft.
Two artifact versions (the shipped one for every domain, a retrained one for `science`) share one multi-LoRA engine:
each request gets its version's adapter and its version's α head."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.hf_reference import cloze_option_probs
from tests.servers import calm_argv, free_port, http, running

pytestmark = pytest.mark.slow
MODEL = "calm-smollm2-135m"


def test_lora_adapter_mode_scores_like_hf_peft(tmp_path, embedded_model_dir, shipped_artifact, shipped_model,
                                               retrained_version):
    from calm_core.artifact import load_artifact
    from calm_core.db import Database
    from calm_core.registry import Registry
    from training.artifact_scoring import load_served_model

    model, tokenizer = shipped_model
    head = shipped_artifact.head
    question, options = "Which planet is largest?", ["Mars", "Jupiter", "Venus", "Mercury"]
    expected = cloze_option_probs(model, tokenizer, question, options, head.scale, head.shift)
    raw = cloze_option_probs(model, tokenizer, question, options)
    registry = Registry(Database(tmp_path / "g.db"), tmp_path / "registry")
    registry.ensure_default(shipped_artifact.path)
    second = load_artifact(retrained_version)  # tests/conftest.py: trained once per run
    v2 = second.manifest.artifact_version
    registry.add(retrained_version, trigger="operator", domain="science")
    registry.promote(v2, "science")
    expected_v2 = cloze_option_probs(load_served_model(str(embedded_model_dir), second.adapter_dir), tokenizer, question,
                                     options, second.head.scale, second.head.shift)
    assert np.abs(np.array(expected_v2) - np.array(expected)).max() > 0.01  # the versions answer differently
    port = free_port()
    env = {"CALM_DB_PATH": str(tmp_path / "g.db"), "CALM_ADAPTER_MODE": "lora", "CALM_ONE_PASS_SCORING": "false"}
    with running(calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/health", tmp_path / "gw.log", env):
        health = http.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": "Bearer dev-admin-key"}).json()
        # The multiple-choice adapter as a vLLM LoRA in the base engine; the free-form mode has its own engine (its head).
        assert health["engine"]["adapter"] == "lora" and health["engine"]["engines"] == ["base", "free_form"]
        # Two versions, two engines: one multi-LoRA engine for both adapters, one free-form engine (the same mode).
        assert health["versions"]["routes"] == {"*": shipped_artifact.manifest.artifact_version, "science": v2}
        assert health["engine"]["engines_in_process"] == 2
        client2 = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        r2 = client2.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                             extra_body={"options": options, "metadata": {"domain": "science"}})
        cal2 = r2.choices[0].model_extra["calibration"]
        assert cal2["artifact_version"] == v2
        np.testing.assert_allclose([o["probability"] for o in cal2["options"]], expected_v2, atol=1e-3)
        assert health["scoring"]["multiple_choice"].startswith("cloze per-token")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                           extra_body={"options": options})
        cal = r.choices[0].model_extra["calibration"]
        chosen = "ABCD".index(r.choices[0].message.content)
        np.testing.assert_allclose([o["probability"] for o in cal["options"]], expected, atol=1e-3)
        assert cal["raw_confidence"] == pytest.approx(raw[chosen], abs=1e-3)
        free = client.chat.completions.create(model=MODEL, max_tokens=10,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in free.choices[0].message.content  # the free-form mode, not the multiple-choice LoRA
