"""The CALM trainer on the real embedded model and real questions (smoke configuration, CI-sized)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calm_core.artifact import load_artifact
from calm_core.errors import ConfigError
from calm_core.hashing import vocab_sha256
from training.config import load_config
from training.trainer import Trainer

pytestmark = pytest.mark.slow
SMOKE = "configs/train/smoke.toml"


def test_top_layers_path_equals_the_full_model(embedded_model, shared_data):
    from calm_core.data import load_mc
    from calm_core.prompts import letter_prompt, letter_token_ids
    from training.scoring import last_position_logits
    from training.top_layers import collate, encode_prefix, last_logits

    model, tokenizer = embedded_model
    prompts = [letter_prompt(tokenizer, q) for q in load_mc("arc_easy", "dev", root=shared_data)[:6]]
    ids = torch.tensor(letter_token_ids(tokenizer)[:4])
    full = last_position_logits(model, tokenizer, prompts)[:, ids]
    with torch.no_grad():
        top = last_logits(model, collate(encode_prefix(model, tokenizer, prompts, 26)), 26, ids)
    torch.testing.assert_close(top, full, atol=1e-4, rtol=1e-4)


def test_packed_cloze_scores_equal_separate_full_model_runs(embedded_model, shared_data):
    """Packing a question with all its options, and running only the top layers, changes no option's log-likelihood;
    a non-trivial α head enters every token's full-vocabulary softmax."""
    from calm_core.data import load_mc
    from calm_core.prompts import cloze_tokens
    from tests.hf_reference import cloze_option_scores
    from training.cloze import encode_packed, option_scores, pack_question, token_logits

    model, tokenizer = embedded_model
    questions = load_mc("openbookqa", "test", root=shared_data)[:3] + load_mc("arc_easy", "dev", root=shared_data)[:3]
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    scale, shift = torch.rand(vocab, generator=gen) + 0.5, torch.randn(vocab, generator=gen)
    expected = [torch.as_tensor(cloze_option_scores(model, tokenizer, q.question, q.choices, scale, shift),
                                dtype=torch.float32) for q in questions]
    with torch.no_grad():
        items = [pack_question(cloze_tokens(tokenizer, q.question, q.choices)) for q in questions]
        encode_packed(model, items, 26, batch_size=4)
        got = option_scores(token_logits(model, items, 26, 5, "cpu"), scale, shift)
    for i, q in enumerate(questions):
        torch.testing.assert_close(got[i, : q.n_options], expected[i], atol=1e-4, rtol=1e-4)


def lora_gradients(model_dir, dtype: str, checkpointing: bool, prompts: list[str], labels: torch.Tensor):
    """The LoRA gradients of one cross-entropy step of the top two layers, and the bytes autograd kept for it."""
    from peft import LoraConfig, get_peft_model

    from training.scoring import load_causal_lm, load_tokenizer
    from training.top_layers import collate, enable_checkpointing, encode_prefix, last_logits

    torch.manual_seed(0)  # the same LoRA initialisation for every variant
    base = load_causal_lm(str(model_dir), dtype)
    top = base.config.num_hidden_layers - 2
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                                            layers_to_transform=[top, top + 1], lora_dropout=0.0))
    if checkpointing:
        enable_checkpointing(model, top)
    batch = collate(encode_prefix(model, load_tokenizer(str(model_dir)), prompts, top))
    kept = []
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def keep(t):  # activations only: the weights a matmul keeps for its backward pass are no new memory
        if t.untyped_storage().data_ptr() not in weights:
            kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logits = last_logits(model, batch, top, torch.arange(labels.max() + 1)).float()
        torch.nn.functional.cross_entropy(logits, labels).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, sum(kept)


def test_checkpointing_keeps_less_for_the_same_gradients_and_bf16_weights_train_alike(embedded_model_dir, shared_data):
    """`gradient_checkpointing` and `dtype = "bfloat16"` (training/config.py), what a 7-8B model needs on one GPU:
    the same step's LoRA gradients, with less kept for the backward pass; bf16 weights give gradients along the
    same direction as float32's."""
    from calm_core.data import load_mc

    questions = load_mc("arc_easy", "dev", root=shared_data)[:4]
    prompts = [q.question for q in questions]
    labels = torch.tensor([q.answer for q in questions])
    plain, plain_bytes = lora_gradients(embedded_model_dir, "float32", False, prompts, labels)
    checkpointed, checkpointed_bytes = lora_gradients(embedded_model_dir, "float32", True, prompts, labels)
    bf16, _ = lora_gradients(embedded_model_dir, "bfloat16", False, prompts, labels)
    assert plain.keys() == checkpointed.keys() == bf16.keys() and len(plain) == 12  # A and B of 3 modules x 2 layers
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7)
    # A LoRA's B starts at zero, so the first step moves only B: its gradients are the ones to compare.
    moving = [name for name in plain if plain[name].norm() > 0]
    assert sorted(moving) == sorted(n for n in plain if "lora_B" in n)
    for name in moving:
        cosine = torch.nn.functional.cosine_similarity(bf16[name].flatten(), plain[name].flatten(), dim=0)
        assert cosine > 0.98, (name, float(cosine))
    assert checkpointed_bytes < 0.5 * plain_bytes, (checkpointed_bytes, plain_bytes)


@pytest.mark.parametrize("answer_format", ["cloze", "letter"])
def test_smoke_run_learns_moves_alpha_and_exports_a_loadable_artifact(tmp_path, embedded_model_dir, answer_format):
    cfg = load_config(SMOKE, out_dir=str(tmp_path / "run"), steps=12, answer_format=answer_format)
    trainer = Trainer(cfg, show_progress=False).setup()
    alpha_before = trainer.alpha.full()[1].detach().clone()
    trainer.train()
    history = trainer.history
    assert len(history) == 12 and all(np.isfinite(h["lambda"]) and h["lambda"] >= 0 for h in history)
    assert any(h["lambda"] > 0 for h in history)  # the coupling term was active
    # g decreases: mean of the last 4 steps below the first 4 (the same 32 questions cycle through).
    assert np.mean([h["g"] for h in history[-4:]]) < np.mean([h["g"] for h in history[:4]])
    moved = (trainer.alpha.full()[1].detach() - alpha_before).abs()[trainer.tracked_tokens]
    assert float(moved.max()) > 1e-4  # α moved on the tokens of the answer options
    metrics = trainer.evaluate()
    path = trainer.export(metrics)
    loaded = load_artifact(path, expect_vocab_size=49152,
                           expect_tokenizer_sha256=vocab_sha256(trainer.tokenizer.get_vocab()))
    assert loaded.manifest.method == "calm" and loaded.adapter_dir is not None
    assert loaded.manifest.answer_format == answer_format
    adapter_config = json.loads((loaded.adapter_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == loaded.manifest.base_model.id  # no machine-local path
    assert not (loaded.adapter_dir / "README.md").exists()
    assert "in_domain/arc_easy" in loaded.manifest.metrics and "all" in loaded.manifest.reference_histograms
    np.testing.assert_allclose(loaded.head.shift, trainer.alpha.full()[1].detach().numpy(), rtol=1e-6)
    log = [json.loads(l) for l in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert {"g", "f", "q", "lambda", "entropy", "step"} <= set(log[0])
    # What the retraining gate may score from (test_init_from_... below): packed cloze questions, not letter prompts.
    from training.frozen_states import FrozenStates

    frozen = FrozenStates.of_sets(trainer.model, trainer.first_trained, trainer.sets)
    assert (frozen is None) == (answer_format == "letter")


def test_resume_after_interruption_matches_an_uninterrupted_run(tmp_path, embedded_model_dir):
    # 2 + 2 steps against 4: the resumed steps need the saved Adam moments, α and both streams' positions (mid-epoch:
    # 32 training and 16 calibration questions, 4 a batch), so a part left out of the checkpoint changes their g.
    full = Trainer(load_config(SMOKE, out_dir=str(tmp_path / "full"), steps=4), show_progress=False).setup()
    full.train()
    first = Trainer(load_config(SMOKE, out_dir=str(tmp_path / "cut"), steps=2, checkpoint_every=2), show_progress=False).setup()
    first.train()  # a kill after step 2 leaves exactly this checkpoint behind
    second = Trainer(load_config(SMOKE, out_dir=str(tmp_path / "cut"), steps=4, checkpoint_every=2), show_progress=False).setup()
    assert second.resume() and second.step == 2
    second.train()
    assert [round(h["g"], 4) for h in second.history] == [round(h["g"], 4) for h in full.history]
    for a, b in zip(full.theta, second.theta):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(full.alpha.full()[1], second.alpha.full()[1], atol=1e-5, rtol=1e-4)
    # A checkpoint of another configuration is refused, not silently continued.
    other = Trainer(load_config(SMOKE, out_dir=str(tmp_path / "cut"), steps=4, lr_alpha=1e-3), show_progress=False).setup()
    with pytest.raises(ConfigError, match="lr_alpha"):
        other.resume()
    # A checkpoint past the configured steps is not a shorter run: refused, or for a report's row started over.
    shorter = Trainer(load_config(SMOKE, out_dir=str(tmp_path / "cut"), steps=2, checkpoint_every=2), show_progress=False).setup()
    with pytest.raises(ConfigError, match="at step 4, past the configured 2 steps"):
        shorter.resume()
    assert not shorter.resume(restart_if_mismatched=True) and shorter.step == 0
    assert not (tmp_path / "cut" / "checkpoint.pt").exists()
    shorter.train()  # its log holds this run's steps only, not the 4 of the removed checkpoint's run
    assert [round(h["g"], 4) for h in shorter.history] == [round(h["g"], 4) for h in full.history[:2]]
    assert len((tmp_path / "cut" / "train_log.jsonl").read_text().splitlines()) == 2


def test_every_registered_method_takes_two_steps_and_moves_what_it_trains(tmp_path, embedded_model_dir):
    """Two steps of each method in the registry: θ moves exactly in those that train it (all but calm_head), α exactly
    in those that train it, and the config's Method names and the steps are the registry's."""
    import typing

    from training.config import Method
    from training.method_specs import SPECS
    from training.methods import STEPS

    assert typing.get_args(Method) == tuple(SPECS) and set(STEPS) == set(SPECS)
    for name, spec in SPECS.items():
        cfg = load_config(SMOKE, method=name, out_dir=str(tmp_path / name), steps=2, eval_every=2, checkpoint_every=2)
        trainer = Trainer(cfg, show_progress=False).setup()
        theta = [p.detach().clone() for p in trainer.theta]
        alpha = [p.detach().clone() for p in trainer.alpha.parameters()]
        for _ in range(2):
            record = STEPS[name](trainer)
            assert np.isfinite(record["g"])
        theta_moved = any(not torch.equal(a, p) for a, p in zip(theta, trainer.theta))
        assert theta_moved == spec.trains_theta, name
        alpha_moved = any(not torch.equal(a, p) for a, p in zip(alpha, trainer.alpha.parameters()))
        assert alpha_moved == spec.trains_alpha, name
        assert trainer.alpha.scalar == (spec.head == "scalar" or cfg.head == "scalar"), name


def test_init_from_starts_theta_and_alpha_at_the_artifact_and_refuses_another_lora_shape(tmp_path, embedded_model_dir):
    """A retraining job continues from the serving version: before any step, the trainer's option probabilities are
    the shipped artifact's, scored as the gateway serves it (training/artifact_scoring.py)."""
    from calm_core.paths import BUNDLED_DIR
    from training.artifact_scoring import load_served_model, option_probabilities

    shipped = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"
    cfg = load_config("configs/train/loop-smoke.toml", out_dir=str(tmp_path / "run"), init_from=str(shipped))
    trainer = Trainer(cfg, show_progress=False).setup()
    data = next(iter(trainer.sets["test_in_domain"].values()))
    artifact = load_artifact(shipped)
    served = option_probabilities(load_served_model(str(trainer.resolved.path), artifact.adapter_dir),
                                  trainer.tokenizer, data.questions, "cloze", artifact.head)
    np.testing.assert_allclose(trainer.probs(data), served[:, : trainer.probs(data).shape[1]], atol=1e-4)

    # The retraining gate then scores the versions from the states training encoded: the served model's bottom (the
    # shipped adapter sits on the same top layers) is the trainer's, so a question runs through the top 4 layers alone.
    from training.frozen_states import FrozenStates, bottom_digest
    from training.top_layers import decoder

    frozen = FrozenStates.of_sets(trainer.model, trainer.first_trained, trainer.sets)
    judged = sum(len(d) for role in ("calibration", "test_in_domain") for d in trainer.sets[role].values())
    assert frozen.layer == trainer.first_trained == 26 and len(frozen.states) == judged  # not the training set's
    served_model = load_served_model(str(trainer.resolved.path), artifact.adapter_dir)
    assert frozen.serve(served_model)
    bottom_rows = []
    hook = decoder(served_model)[0].layers[0].register_forward_hook(lambda m, args, out: bottom_rows.append(len(out)))
    held = len(frozen.states)
    from_states = option_probabilities(served_model, trainer.tokenizer, data.questions, "cloze", artifact.head,
                                       frozen=frozen)
    hook.remove()
    np.testing.assert_allclose(from_states, served, atol=1e-5)
    # The engine packs a question in another option order, and a token every option starts with in its prompt (1 of
    # these 16): the states do not depend on either, so no question ran through the bottom.
    from calm_core.prompts import cloze_tokens

    # (A guard on the data: the case above is in these questions.)
    firsts = [{option[0] for option in cloze_tokens(trainer.tokenizer, q.question, q.choices).options} for q in data.questions]
    assert sum(len(tokens) == 1 for tokens in firsts) == 1
    assert len(frozen.states) == held and bottom_rows == [], bottom_rows
    # A model whose bottom differs in one weight, or whose config says another norm epsilon, is not served from them.
    served_model.config.rms_norm_eps *= 10
    assert not frozen.serve(served_model)
    served_model.config.rms_norm_eps /= 10
    served_model.config.use_cache = not served_model.config.use_cache  # what a forward returns, not its states
    assert frozen.serve(served_model)
    with torch.no_grad():
        decoder(served_model)[0].layers[3].mlp.down_proj.weight[0, 0] += 1e-3
    assert not frozen.serve(served_model) and bottom_digest(served_model, 3) == bottom_digest(trainer.model, 3)

    cold = Trainer(load_config("configs/train/loop-smoke.toml", out_dir=str(tmp_path / "cold")), show_progress=False).setup()
    assert np.abs(cold.probs(data) - trainer.probs(data)).max() > 1e-2  # without it: the base model, identity head

    with pytest.raises(ConfigError, match="differs from this config"):
        Trainer(load_config(SMOKE, out_dir=str(tmp_path / "other"), init_from=str(shipped)), show_progress=False).setup()
