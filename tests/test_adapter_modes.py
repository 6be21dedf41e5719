"""CUDA's default adapter mode, run on the CPU: the artifact's adapter as a vLLM LoRA inside the in-process engine
(`CALM_ADAPTER_MODE=lora`) instead of a merged copy, scored per token. Same numbers as HF transformers + peft."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.hf_reference import cloze_option_probs
from tests.servers import calm_argv, free_port, running

pytestmark = pytest.mark.slow
MODEL = "calm-smollm2-135m"


def test_lora_adapter_mode_scores_like_hf_peft(tmp_path, embedded_model_dir, shipped_artifact, shipped_model):
    model, tokenizer = shipped_model
    head = shipped_artifact.head
    question, options = "Which planet is largest?", ["Mars", "Jupiter", "Venus", "Mercury"]
    expected = cloze_option_probs(model, tokenizer, question, options, head.scale, head.shift)
    raw = cloze_option_probs(model, tokenizer, question, options)
    port = free_port()
    env = {"CALM_DB_PATH": str(tmp_path / "g.db"), "CALM_ADAPTER_MODE": "lora", "CALM_ONE_PASS_SCORING": "false"}
    with running(calm_argv("serve", "--port", str(port)), f"http://127.0.0.1:{port}/health", tmp_path / "gw.log", env):
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        # The multiple-choice adapter as a vLLM LoRA in the base engine; the free-form mode has its own engine (its head).
        assert health["engine"]["adapter"] == "lora" and health["engine"]["engines"] == ["base", "free_form"]
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
