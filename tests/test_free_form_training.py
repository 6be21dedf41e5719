"""Generative (free-form) CALM on the real embedded model and real TriviaQA/PopQA questions (CI-sized)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calm_core.errors import ConfigError
from training.config import load_config
from training.trainer import Trainer

pytestmark = pytest.mark.slow
SMOKE = "configs/train/open-smoke.toml"


def test_answer_nll_is_the_full_model_cross_entropy_of_the_gold_answer(embedded_model, shared_data):
    """The packed top-layers path gives each answer's mean calibrated token NLL exactly as the whole model does on
    prompt + answer, the end-of-turn token included."""
    from calm_core.data import load_open
    from training.alpha_params import AlphaParams
    from training.generative import GenerativeFormat, answer_nll, encode_text, free_form_prompt, gold_target

    model, tokenizer = embedded_model
    questions = load_open("triviaqa", root=shared_data)[:4] + load_open("popqa", "dev", root=shared_data)[:2]
    fmt = GenerativeFormat(tokenizer, {q.id: gold_target(tokenizer, q) for q in questions})
    vocab = model.config.vocab_size
    alpha = AlphaParams(vocab)
    with torch.no_grad():
        alpha.log_scale.copy_(torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 0.2)
        alpha.shift.copy_(torch.randn(vocab, generator=torch.Generator().manual_seed(1)))
        items = fmt.encode(model, tokenizer, questions, 26, 4)
        got = answer_nll(fmt.forward(model, items, 26, 1, "cpu"), alpha)
    d, l = alpha.full()
    for i, q in enumerate(questions):
        prompt, answer = encode_text(tokenizer, free_form_prompt(tokenizer, q.question)), fmt.targets[q.id]
        assert answer[-1] == tokenizer.eos_token_id and tokenizer.decode(answer[:-1]) == q.answer.strip()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits * d.detach() + l.detach(), -1)
        expected = -logp.gather(1, torch.tensor(answer)[:, None]).mean()
        assert float(got[i]) == pytest.approx(float(expected), abs=1e-4)


def test_every_free_form_method_trains_on_gold_answers_and_greedy_calibration_positions(tmp_path, embedded_model_dir):
    from training.method_specs import SPECS

    applies = [name for name, spec in SPECS.items() if spec.free_form]
    assert "cft" not in applies and {"sft", "calm", "calm_scalar", "iterate", "regularization"} <= set(applies)
    for name in applies:
        # The last method without a quick evaluation (eval_every 0, as the loop's free-form stage trains): none logged.
        every = 0 if name == applies[-1] else 2
        cfg = load_config(SMOKE, method=name, out_dir=str(tmp_path / name), steps=2, eval_every=every, checkpoint_every=2)
        assert cfg.entropy_over == "vocab"  # free-form answers have no options
        trainer = Trainer(cfg, show_progress=False).setup()
        theta = [p.detach().clone() for p in trainer.theta]
        alpha = [p.detach().clone() for p in trainer.alpha.parameters()]
        trainer.train()
        assert all(np.isfinite(h["g"]) for h in trainer.history)
        assert ("val_gold_nll" in trainer.history[-1]) == (every > 0), name
        assert any(not torch.equal(a, p) for a, p in zip(theta, trainer.theta)) == SPECS[name].trains_theta, name
        assert any(not torch.equal(a, p) for a, p in zip(alpha, trainer.alpha.parameters())) == SPECS[name].trains_alpha
    # The calibration set's targets are the initial model's own greedy answers (unlabelled), not gold answers.
    calib = trainer.calib_set
    gold = [tuple(trainer.tokenizer(q.answer, add_special_tokens=False)["input_ids"]) for q in calib.questions]
    targets = [tuple(int(t) for t in item.targets) for item in calib.items]
    assert sum(t[: len(g)] == g for t, g in zip(targets, gold)) < len(gold) / 2
    assert all(len(t) <= 32 for t in targets)


def test_calibration_answers_an_engine_served_are_trained_on_as_given_and_the_rest_generated(tmp_path,
                                                                                              embedded_model_dir,
                                                                                              monkeypatch):
    """A retraining job hands the trainer its active mode's served answers (`calibration_answers`): those are the
    calibration targets, cut as a generated answer is (at most 32 tokens, ending at the end-of-turn token), and only
    the questions the file lacks are generated."""
    import json

    from training.generative import calibration_targets

    cfg = load_config(SMOKE, method="calm_scalar", out_dir=str(tmp_path / "generated"), steps=1, eval_every=0)
    generated = Trainer(cfg, show_progress=False).setup()
    calib = generated.split.role("calibration")
    eos = generated.tokenizer.eos_token_id
    assert len(calib) >= 4
    given = {calib[0].id: list(range(1000, 1040)), calib[1].id: [1000, 1001, eos, 1002], calib[2].id: []}
    expected = {calib[0].id: tuple(range(1000, 1032)), calib[1].id: (1000, 1001, eos), calib[2].id: (eos,)}
    (tmp_path / "answers.json").write_text(json.dumps(given))
    import training.generative as generative

    asked, generate = [], generative.greedy_targets

    def recorded(model, tokenizer, questions, *args, **kwargs):
        asked.extend(q.id for q in questions)
        return generate(model, tokenizer, questions, *args, **kwargs)

    monkeypatch.setattr(generative, "greedy_targets", recorded)
    cfg_served = cfg.model_copy(update={"out_dir": str(tmp_path / "served"),
                                        "calibration_answers": str(tmp_path / "answers.json")})
    served = Trainer(cfg_served, show_progress=False).setup()
    assert sorted(asked) == sorted(q.id for q in calib[3:])  # only the questions the file lacks were generated
    assert calibration_targets(cfg_served) == {"served": 3, "generated": len(calib) - 3}
    for q in calib:
        assert served.fmt.targets[q.id] == expected.get(q.id, generated.fmt.targets[q.id]), q.id
    # ... and they are what the upper level is encoded at.
    encoded = {q.id: tuple(int(t) for t in item.targets) for q, item in zip(served.calib_set.questions,
                                                                             served.calib_set.items)}
    assert {k: encoded[k] for k in expected} == expected


def test_free_form_configs_are_checked_against_the_split(tmp_path, embedded_model_dir):
    with pytest.raises(ConfigError, match="does not apply to free-form"):
        load_config(SMOKE, method="cft")
    cfg = load_config(SMOKE, answer_format="cloze", out_dir=str(tmp_path / "x"))
    with pytest.raises(ConfigError, match="open-ended"):
        Trainer(cfg, show_progress=False).setup()
