"""Training math without a model: the BOME step, the objectives, post-hoc fits, configs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from training.bome import bome_direction
from training.config import TrainConfig, load_config
from training.objectives import cft_gap, cross_entropy, entropy, mask_options
from training.posthoc import fit_daca_temperature, fit_temperature, fit_token_temperature, fit_vector_scaling

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs" / "train").glob("*.toml"))


def test_bome_lambda_formula_and_descent_on_q():
    gf = [torch.tensor([1.0, 0.0]), torch.tensor([0.5])]
    gq = [torch.tensor([-1.0, 1.0]), torch.tensor([0.0])]
    step = bome_direction(gf, gq, eta=0.5)
    q_sq, inner = 2.0, -1.0
    assert step.grad_q_sq == pytest.approx(q_sq) and step.inner == pytest.approx(inner)
    assert step.lam == pytest.approx((0.5 * q_sq - inner) / q_sq)
    # Along the direction q decreases at rate at least φ = η‖∇q‖².
    rate = sum(float((d * g).sum()) for d, g in zip(step.direction, gq))
    assert rate >= 0.5 * q_sq - 1e-9
    # When ∇f already decreases q fast enough, λ is 0 and the step is ∇f alone.
    easy = bome_direction([torch.tensor([-2.0, 2.0])], [torch.tensor([-1.0, 1.0])], eta=0.5)
    assert easy.lam == 0.0 and torch.equal(easy.direction[0], torch.tensor([-2.0, 2.0]))
    with pytest.raises(ValueError, match="same parameters"):
        bome_direction(gf, gq[:1], eta=0.5)


def test_bome_solves_a_toy_bilevel_problem():
    """min_x f = (x - 3)² s.t. y ∈ argmin_y g = (y - x)²  ->  x = y = 3, found by the first-order step."""
    x, y = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    for _ in range(300):
        f = ((y - 3) ** 2).sum()
        g = ((y - x) ** 2).sum()
        y_tilde = (y - 0.4 * torch.autograd.grad(g, y, retain_graph=True)[0]).detach()
        q = g - ((y_tilde - x) ** 2).sum()
        grad_f = torch.autograd.grad(f, [x, y], allow_unused=True)
        grad_f = [torch.zeros(1) if t is None else t for t in grad_f]
        step = bome_direction(grad_f, list(torch.autograd.grad(q, [x, y])), eta=0.5)
        with torch.no_grad():
            x -= 0.05 * step.direction[0]
            y -= 0.05 * step.direction[1]
    assert float(x) == pytest.approx(3.0, abs=0.05) and float(y) == pytest.approx(3.0, abs=0.05)


def test_objectives():
    logits = mask_options(torch.tensor([[2.0, 0.0, 1.0, 5.0]]), torch.tensor([3]))
    labels = torch.tensor([0])
    logp = torch.log_softmax(torch.tensor([2.0, 0.0, 1.0]), -1)
    assert float(cross_entropy(logits, labels)) == pytest.approx(-float(logp[0]))
    smoothed = 0.9 * -float(logp[0]) + 0.1 * -float(logp.mean())
    assert float(cross_entropy(logits, labels, 0.1)) == pytest.approx(smoothed)
    uniform = mask_options(torch.zeros(1, 5), torch.tensor([4]))
    assert float(entropy(uniform)[0]) == pytest.approx(math.log(4))
    conf_logits = torch.log(torch.tensor([[0.8, 0.2]]))
    assert float(cft_gap(conf_logits, torch.tensor([0.0] * 8 + [0.5, 0.0]))) == pytest.approx((0.8 - 0.5) ** 2)


def test_posthoc_fits_recover_known_parameters():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(4000, 4)) * 3
    true_t = 2.5
    p = np.exp(z / true_t) / np.exp(z / true_t).sum(1, keepdims=True)
    labels = np.array([rng.choice(4, p=row) for row in p])
    n = np.full(4000, 4)
    assert fit_temperature(z, labels, n) == pytest.approx(true_t, rel=0.1)
    d, l = fit_vector_scaling(z, labels, n)
    np.testing.assert_allclose(d, 1 / true_t, rtol=0.15)
    assert np.abs(l - l.mean()).max() < 0.15


def test_daca_recovers_the_temperature_from_agreeing_rows_only():
    """A fine-tuned model twice as sharp as the reference: DACA's T is 2, fitted without labels; rows where the two
    disagree are left out (here they would pull T far off)."""
    rng = np.random.default_rng(0)
    reference = rng.normal(size=(2000, 6)) * 2
    target = reference * 2.0
    assert fit_daca_temperature(reference, target) == pytest.approx(2.0, rel=1e-3)
    flipped = target.copy()
    flipped[:500] = -flipped[:500]  # disagreeing rows: ignored
    assert fit_daca_temperature(reference, flipped) == pytest.approx(2.0, rel=1e-3)
    options = np.where(np.arange(6) < 4, reference, -np.inf)  # multiple choice: padded option slots carry no mass
    assert fit_daca_temperature(options, options * 3) == pytest.approx(3.0, rel=1e-3)
    assert fit_daca_temperature(reference[:5], -reference[:5]) == 1.0  # nothing agrees: no evidence, T stays 1


def test_token_temperature_scaling_recovers_a_known_temperature():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(3000, 50, generator=gen) * 4
    targets = torch.multinomial(torch.softmax(z / 2.5, -1), 1, generator=gen).squeeze(1)
    assert fit_token_temperature(z, targets) == pytest.approx(2.5, rel=0.1)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_training_config_validates(path):
    cfg = load_config(path)
    assert Path(cfg.split).is_file()
    assert "calm train --config" in path.read_text().splitlines()[1] or "calm train --config" in path.read_text()


def test_config_rejects_unknown_keys_and_bad_values(tmp_path):
    from calm_core.errors import ConfigError

    bad = tmp_path / "bad.toml"
    bad.write_text('method = "calm"\nlearning_rate = 1\n')
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(bad)
    bad.write_text('method = "magic"\n')
    with pytest.raises(ConfigError, match="method"):
        load_config(bad)
    assert TrainConfig(method="calm_scalar").head == "scalar"


def test_packed_mask_lets_each_option_see_the_prompt_and_itself_only():
    from training.cloze import packed_mask

    segment = torch.tensor([[0, 0, 1, 1, 2, -1]])
    m = packed_mask(segment)[0, 0]
    assert m[3].tolist() == [True, True, True, True, False, False]  # option 1 token: prompt + own earlier token
    assert m[4].tolist() == [True, True, False, False, True, False]  # option 2 never sees option 1
    assert m[1].tolist() == [True, True, False, False, False, False]  # prompt is causal
    assert not m[:, 5][:5].any() and m[5, 5]  # no real token sees padding; no row is fully masked


def test_option_scores_are_mean_calibrated_token_log_likelihoods():
    from training.cloze import TokenLogits, option_scores, token_entropy

    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    raw = TokenLogits(logits, targets=torch.tensor([0, 1, 2]), slot=torch.tensor([0, 0, 1]), rows=1, width=3)
    scale, shift = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([0.0, 1.0, 0.0])
    logp = torch.log_softmax(logits * scale + shift, -1)
    got = option_scores(raw, scale, shift)
    assert got.shape == (1, 3)
    assert float(got[0, 0]) == pytest.approx(float(logp[0, 0] + logp[1, 1]) / 2)
    assert float(got[0, 1]) == pytest.approx(float(logp[2, 2]))
    assert float(got[0, 2]) == 0.0  # no option in that slot: left for the caller's mask
    assert float(token_entropy(raw, scale, shift)[0]) == pytest.approx(float(entropy(logits * scale + shift).mean()))
    # Training's batched rule is the serving rule: calm_core.scoring.cloze_scores on the same token log-probs.
    from calm_core.scoring import cloze_scores

    served = cloze_scores([[float(logp[0, 0]), float(logp[1, 1])], [float(logp[2, 2])]])
    np.testing.assert_allclose(got[0, :2].double().numpy(), served, rtol=1e-6)


def test_atomic_dir_replaces_a_folder_or_keeps_a_cache_another_process_wrote(tmp_path):
    from calm_core.atomic import atomic_dir

    target = tmp_path / "folder"
    with atomic_dir(target) as tmp:
        (tmp / "f").write_text("first")
    with atomic_dir(target) as tmp:
        (tmp / "f").write_text("second")
    assert (target / "f").read_text() == "second"
    with atomic_dir(target, keep_existing=True) as tmp:  # a merge cache: the copy already there may be in use
        (tmp / "f").write_text("third")
    assert (target / "f").read_text() == "second" and sorted(p.name for p in tmp_path.iterdir()) == ["folder"]
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "f").write_text("broken")
        raise RuntimeError
    assert (target / "f").read_text() == "second" and sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


def test_splits_that_share_a_set_encode_it_once(tmp_path):
    """Retraining jobs train on the same training and test sets beside each job's own captured prompts: each set is
    cached on its own, so a second split encodes only its new set, and a set's questions keep their own states."""
    from types import SimpleNamespace

    from calm_core.data import MCQuestion
    from calm_core.splits import ROLES
    from training.features import encode_sets

    def questions(name: str, n: int) -> list[MCQuestion]:
        return [MCQuestion(f"{name}-{i}", name, "dev", f"{name} question {i}?", ("a", "b"), i % 2, "science")
                for i in range(n)]

    encoded = []
    fmt = SimpleNamespace(name="letter", fingerprint=lambda tok, q: q.question,
                          encode=lambda model, tok, qs, first, bs, advance: encoded.append(len(qs)) or
                          [torch.tensor([float(len(q.question))]) for q in qs])
    train, tests = questions("train", 3), questions("tests", 4)

    def split(calibration: list[MCQuestion]):
        sources = {role: {} for role in ROLES}
        sources.update(train={"train": train}, calibration={"captured": calibration}, test_in_domain={"tests": tests})
        return SimpleNamespace(sources=sources)

    first = encode_sets(None, None, split(questions("job-one", 5)), 26, "w", tmp_path, fmt)
    second = encode_sets(None, None, split(questions("job-two", 6)), 26, "w", tmp_path, fmt)
    assert encoded == [3, 5, 4, 6]  # the second job encoded its 6 captured prompts only
    assert [float(h) for h in second["test_in_domain"]["tests"].items] == [len(q.question) for q in tests]
    assert second["test_in_domain"]["tests"].labels.tolist() == [0, 1, 0, 1]
    assert len(first["calibration"]["captured"]) == 5 and len(second["calibration"]["captured"]) == 6


def test_frozen_states_are_reassembled_for_any_option_order_and_prompt_cut():
    """A packed row's state depends only on its sequence up to it (the prompt, then its own option): states kept from
    training's packing (prompt | options in the question's order) give the engine's packing (options sorted, a token
    every option starts with moved into the prompt) exactly the rows it would compute."""
    from calm_core.prompts import ClozeTokens
    from training.cloze import pack_question
    from training.frozen_states import FrozenStates, question_key

    def states(q) -> torch.Tensor:  # a stand-in model: each row's state a function of its sequence so far
        prompt = q.input_ids[q.segment == 0].tolist()
        rows = []
        for row in range(len(q)):
            own = [int(t) for t, s in zip(q.input_ids[: row + 1], q.segment[: row + 1]) if s in (0, q.segment[row])]
            assert own[: len(prompt)] == prompt[: len(own)]
            rows.append(torch.tensor([float(hash(tuple(own)) % 10007), float(len(own))]))
        return torch.stack(rows)

    trained = pack_question(ClozeTokens((1, 2, 3), ((7, 8), (7, 9, 10), (7, 11))))
    frozen = FrozenStates(2, "digest", torch.float32)
    frozen.add(trained, states(trained))
    served = pack_question(ClozeTokens((1, 2, 3, 7), ((9, 10), (8,), (11,))))  # sorted elsewhere, 7 in the prompt
    assert served in frozen and question_key(served) == question_key(trained)
    assert torch.equal(frozen.rows(served), states(served))
    assert torch.equal(frozen.rows(trained), states(trained))
    assert pack_question(ClozeTokens((1, 2, 3), ((7, 8), (7, 9, 10)))) not in frozen  # another question
    empty_prompt = pack_question(ClozeTokens((), ((4,),)))
    frozen.add(empty_prompt, states(empty_prompt))
    assert torch.equal(frozen.rows(empty_prompt), states(empty_prompt))
