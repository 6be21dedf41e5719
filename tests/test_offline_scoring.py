"""One "as served" path: offline evaluation (`calm eval --artifact`, the reports, the retraining gate) and the gateway
score real questions through the same scorers, so on the same engine they agree to 1e-6.

The engine is the offline one (transformers, training/offline_engine.py) on the shipped artifact's weights; the
gateway gets it injected, as the CLI injects vLLM. That the offline engine's numbers are vLLM's is checked by the HF
equivalence tests of the gateway suites.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from calm_core.artifact import LoadedArtifact
from calm_core.data import load_mc
from gateway.app import create_app
from gateway.settings import GatewaySettings
from training.artifact_scoring import load_served_model, option_probabilities
from training.offline_engine import OfflineEngine
from training.scoring import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(embedded_model_dir, shipped_artifact):
    return load_served_model(str(embedded_model_dir), shipped_artifact.adapter_dir), load_tokenizer(str(embedded_model_dir))


def as_format(artifact: LoadedArtifact, answer_format: str) -> LoadedArtifact:
    """The shipped artifact's weights and head, scored in the given answer format (not registered anywhere)."""
    copy = LoadedArtifact.__new__(LoadedArtifact)
    object.__setattr__(copy, "manifest", artifact.manifest.model_copy(update={"answer_format": answer_format}))
    return copy


@pytest.mark.parametrize("answer_format", ["cloze", "letter"])
def test_offline_evaluation_and_the_gateway_score_real_questions_alike(served, shipped_artifact, shared_data, tmp_path,
                                                                        answer_format):
    model, tokenizer = served
    questions = load_mc("arc_easy", "test", shared_data)[:12] + load_mc("mmlu", "test", shared_data)[:12]
    offline = option_probabilities(model, tokenizer, questions, answer_format, shipped_artifact.head)
    # Through the gateway (one request, one unbatched pass each: the test's cost) the first 8 of each set: each question
    # is one more case of the same comparison (4 options each, the right answer at every letter in either set).
    asked = list(range(8)) + list(range(12, 20))

    engine = OfflineEngine(model, tokenizer, shipped_artifact.head, artifact_version="shipped")
    engine.model_name = "calm"
    settings = GatewaySettings(db_path=tmp_path / "g.db", served_model_name="calm", raw_confidence=False)
    app = create_app(settings, engine, tokenizer, as_format(shipped_artifact, answer_format))
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
        served_probs = []
        for q in (questions[i] for i in asked):
            r = client.chat.completions.create(model="calm", messages=[{"role": "user", "content": q.question}],
                                               extra_body={"options": list(q.choices)})
            calibration = r.choices[0].model_extra["calibration"]
            served_probs.append([o["probability"] for o in calibration["options"]])
            assert r.choices[0].message.content == "ABCDEFGHIJKLM"[int(np.argmax(served_probs[-1]))]
        paths = http.get("/health", headers={"Authorization": "Bearer dev-admin-key"}).json()["scoring"]["multiple_choice"]
    assert paths.startswith("cloze one-pass" if answer_format == "cloze" else "letter")
    for row, probs in zip(asked, served_probs):
        np.testing.assert_allclose(probs, offline[row, : len(probs)], atol=1e-6)
    accuracy = np.mean(offline.argmax(1) == [q.answer for q in questions])
    assert 0.2 < accuracy < 0.9  # real questions, a real (tiny) model: neither broken nor trivial



def test_versions_that_differ_by_their_heads_alone_share_each_forward_pass(served, embedded_model_dir,
                                                                           shipped_artifact, shared_data, tmp_path,
                                                                           monkeypatch):
    """The retraining gate scores a head-only candidate (CALM with θ held) beside its parent: one load of the model and
    one forward pass per question serve both, and each version gets exactly the numbers it gets scored alone (cloze
    and letter). A version with another adapter shares nothing."""
    import json

    import safetensors.torch

    import training.artifact_scoring as scoring
    import training.cloze as cloze
    import training.offline_engine as engine
    from calm_core.alpha_head import AlphaHead
    from calm_core.artifact import load_artifact, save_artifact

    manifest, head, adapter = shipped_artifact.manifest, shipped_artifact.head, shipped_artifact.adapter_dir
    flatter = AlphaHead(np.asarray(head.scale) * 0.5, np.asarray(head.shift))
    # The head-only candidate's adapter as training exports it: the same tensors, written apart, its config naming the
    # base model by id and listing the LoRA's target modules (a set) in another order.
    config = json.loads((adapter / "adapter_config.json").read_text())
    exported = tmp_path / "exported-adapter"
    exported.mkdir()
    (exported / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "elsewhere",
                                                              "target_modules": config["target_modules"][::-1]}))
    tensors = safetensors.torch.load_file(str(adapter / "adapter_model.safetensors"))
    safetensors.torch.save_file(dict(reversed(tensors.items())), str(exported / "adapter_model.safetensors"))
    moved = tmp_path / "moved-adapter"
    moved.mkdir()
    (moved / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] * 5
    safetensors.torch.save_file(tensors, str(moved / "adapter_model.safetensors"))
    made = {"cloze-parent": (head, adapter, "cloze"), "cloze-head-only": (flatter, exported, "cloze"),
            "letter-parent": (head, adapter, "letter"), "letter-head-only": (flatter, exported, "letter"),
            "other-adapter": (head, moved, "cloze")}
    for name, (h, a, fmt) in made.items():
        save_artifact(tmp_path / name, h, adapter_dir=a, answer_format=fmt, base_model=manifest.base_model,
                      tokenizer=manifest.tokenizer, method="calm_head")
    versions = [load_artifact(tmp_path / name) for name in made]
    assert scoring.same_weights(versions[0], versions[3]) and not scoring.same_weights(versions[0], versions[4])

    questions = load_mc("arc_easy", "dev", root=shared_data)[:6]
    loads, packed_forwards = [], []
    load, run = scoring.load_served_model, engine.run_layers_masked
    monkeypatch.setattr(scoring, "load_served_model", lambda *a, **k: loads.append(a) or load(*a, **k))
    monkeypatch.setattr(engine, "run_layers_masked", lambda *a, **k: packed_forwards.append(1) or run(*a, **k))
    # The frozen bottom's missing states are encoded as training encodes them (training/cloze.py): counted too.
    monkeypatch.setattr(cloze, "run_layers_masked", lambda *a, **k: packed_forwards.append(1) or run(*a, **k))
    # Three sets, as the gate scores them (captured prompts, test questions, uploaded labels: here none).
    sets = (questions[:4], questions[4:], [])
    lm_head_rows, make_decoder = [], engine.decoder

    def counting_decoder(model):
        stack, lm_head = make_decoder(model)
        return stack, lambda states: lm_head_rows.append(len(states)) or lm_head(states)

    monkeypatch.setattr(engine, "decoder", counting_decoder)
    together = scoring.served_probabilities(versions, str(embedded_model_dir), *sets)
    assert len(loads) == 2  # the shipped adapter's four versions: one load; the other adapter: its own
    assert len(packed_forwards) == 4  # cloze: one batch per set and set of weights, not one per version
    # The LM head too runs once per packed question for the versions sharing the weights (the memo keeps its logits):
    # both cloze versions of the shipped adapter cost what one does, as much as the other adapter's one.
    rows_together = sum(lm_head_rows)
    lm_head_rows.clear()
    scoring.served_probabilities(versions[:1], str(embedded_model_dir), *sets)
    assert rows_together == 2 * sum(lm_head_rows) > 0
    # Sharers go through the questions a chunk at a time (a memo per chunk bounds the logits kept): the same numbers,
    # the same LM-head rows, the 4 questions of the first set in chunks of 3 and 1.
    rows_alone = sum(lm_head_rows)
    lm_head_rows.clear()
    packed_forwards.clear()
    with monkeypatch.context() as patched:
        patched.setattr(scoring, "SHARED_CHUNK", 3)
        chunked = scoring.served_probabilities(versions[:2], str(embedded_model_dir), *sets)
    assert sum(lm_head_rows) == rows_alone and len(packed_forwards) == 3  # a batch per chunk: 3 + 1 questions, then 2
    for got, want in zip(chunked, together[:2]):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert [len(p[2]) for p in together] == [0] * 5
    model, tokenizer = served
    for (name, (h, _, fmt)), probs in zip(list(made.items())[:4], together):
        for got, qs in zip(probs, sets[:2]):
            np.testing.assert_allclose(got, option_probabilities(model, tokenizer, qs, fmt, h), atol=1e-6, err_msg=name)
    assert np.abs(together[0][0] - together[1][0]).max() > 0.01  # each head applied to its own version
    assert np.abs(together[4][0] - together[0][0]).max() > 1e-3  # the other adapter's own forward pass

    # Both adapters sit on the top 4 layers: with a frozen bottom to share (the trainer's states, in the gate; empty
    # here), the shipped adapter's versions compute it and the other adapter's version runs its top layers from it.
    from training.frozen_states import FrozenStates

    frozen = FrozenStates.of_model(model, 26)
    packed_forwards.clear()
    shared = scoring.served_probabilities(versions, str(embedded_model_dir), *sets, frozen=frozen)
    assert len(packed_forwards) == 2 * 2 + 2 and len(frozen.states) == 6  # bottom + top per set, then top alone
    for got, want in zip(shared, together):
        for a, b in zip(got[:2], want[:2]):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # States of another bottom serve no version: each runs its whole model. (Here they are zeros for the same
    # questions under another digest: used, they would change every probability.)
    from training.frozen_states import QuestionStates

    zeros = {key: QuestionStates(kept.prompt_ids, kept.prompt * 0, {o: t * 0 for o, t in kept.options.items()})
             for key, kept in frozen.states.items()}
    other = FrozenStates(26, "another bottom", frozen.dtype, zeros)
    alone = scoring.served_probabilities(versions[:1], str(embedded_model_dir), sets[0], frozen=other)
    np.testing.assert_allclose(alone[0][0], together[0][0], atol=1e-6)


def test_the_offline_engine_runs_its_lm_head_only_where_prompt_log_probs_are_read(served, shipped_artifact, shared_data):
    """A cloze option's request says from which prompt position its log-probs are read (the option's tokens, after the
    question): the offline engine runs the LM head on the packed question from there, and the positions read are the
    numbers of a request that reads them all (1e-6); those before come back NaN."""
    import asyncio

    from calm_core.engine import EngineRequest, generate

    model, tokenizer = served
    question = load_mc("arc_easy", "test", shared_data)[0]
    prompt = tuple(tokenizer(question.question + "\nAnswer:", add_special_tokens=False)["input_ids"])
    options = [tuple(tokenizer(" " + c, add_special_tokens=False)["input_ids"]) for c in question.choices]
    n = len(prompt)
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))

    def answers(read_from: int):
        engine = OfflineEngine(model, tokenizer, shipped_artifact.head)
        requests = [EngineRequest(request_id=str(k), prompt="", prompt_token_ids=prompt + o, max_tokens=1,
                                  prompt_logprobs=True, folded=True, calibrated=False, prompt_logprobs_from=read_from)
                    for k, o in enumerate(options)]

        async def run():
            return await asyncio.gather(*(generate(engine, r) for r in requests))
        return asyncio.run(run())

    try:
        whole, read = answers(0), answers(n)
    finally:
        hook.remove()
    assert rows[1] == rows[0] - (n - 1) and n > 10  # one packed question each time; the question's rows skipped
    for o, a, b in zip(options, whole, read):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == n + len(o)
        assert all(np.isnan(b.prompt_logprobs[: n]))
        np.testing.assert_allclose(b.prompt_logprobs[n:], a.prompt_logprobs[n:], atol=1e-6)
        assert a.token_ids == b.token_ids and a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-6)
