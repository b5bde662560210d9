"""The DPO family's loss (`hpref.models.dpo_loss`) against hand computations and TRL's formulas: if
these fail, offline and online DPO optimise something other than the objective their docs name."""

from __future__ import annotations

import math

import pytest
import torch

from hpref.models.dpo_loss import answer_logprobs, dpo_loss, mean_metrics, pair_metrics

WIN, LOSS, TIE = [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]


def _pair(values, targets):
    a, b, ra, rb = (torch.tensor(v, dtype=torch.float32) for v in values)
    return a, b, ra, rb, torch.tensor(targets)


def test_sigmoid_is_trls_dpo_with_label_smoothing():
    # TRL: -logsigmoid(beta h) (1 - eps) - logsigmoid(-beta h) eps, h = (a - ra) - (b - rb)
    a, b, ra, rb, t = _pair(([-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0], [-4.2, -3.0]), [WIN, WIN])
    beta, eps = 0.1, 0.1
    out = dpo_loss(a, b, ra, rb, t, beta=beta, loss_type="sigmoid", label_smoothing=eps)
    for i in range(2):
        h = float((a[i] - ra[i]) - (b[i] - rb[i]))
        want = (
            -math.log(1 / (1 + math.exp(-beta * h))) * (1 - eps)
            - math.log(1 / (1 + math.exp(beta * h))) * eps
        )
        assert float(out.loss[i]) == pytest.approx(want, rel=1e-5)
    assert torch.allclose(out.reward_a, beta * (a - ra))


def test_ipo_regresses_the_margin_to_half_beta_inverse_and_ties_to_zero():
    a, b, ra, rb, t = _pair(
        ([-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0], [-1.0] * 3, [-1.0] * 3), [WIN, LOSS, TIE]
    )
    beta = 0.5  # goal 1/(2 beta) = 1
    out = dpo_loss(a, b, ra, rb, t, beta=beta, loss_type="ipo")
    # h = 0 - (-1) = 1: a win is exactly on target, a loss is 2 away, a tie 1 away
    assert out.loss.tolist() == pytest.approx([0.0, 4.0, 1.0])


def test_ties_pull_rewards_together_and_wins_push_them_apart():
    """A tie's gradient moves the margin toward 0 under every loss type (never dropped); a win's
    moves it up."""
    for loss_type in ("sigmoid", "ipo", "davidson"):
        for target, sign in ((TIE, -1.0), (WIN, 1.0)):
            a = torch.tensor([-1.0], requires_grad=True)
            b = torch.tensor([-1.5])
            dpo_loss(
                a,
                b,
                torch.tensor([-1.2]),
                torch.tensor([-1.2]),
                torch.tensor([target]),
                beta=0.1,
                loss_type=loss_type,
            ).loss.sum().backward()
            # margin is +0.5 now (IPO's goal for a win is 1 / (2 beta) = 5): a tie wants it lower
            # (positive grad on a), a win higher
            assert float(a.grad) * -sign > 0, (loss_type, target)


def test_davidson_is_the_three_way_cross_entropy_and_reduces_to_dpo_without_ties():
    a, b, ra, rb, t = _pair(([-1.0], [-2.0], [-1.5], [-1.5]), [TIE])
    beta, nu = 1.0, 1.0
    out = dpo_loss(a, b, ra, rb, t, beta=beta, loss_type="davidson", tie_strength=nu)
    r_a, r_b = 0.5, -0.5
    z = math.exp(r_a) + math.exp(r_b) + nu * math.exp((r_a + r_b) / 2)
    assert float(out.loss[0]) == pytest.approx(-math.log(nu * math.exp(0.0) / z), rel=1e-5)
    # nu -> 0: a win's loss is DPO's
    tiny_nu = dpo_loss(a, b, ra, rb, torch.tensor([WIN]), beta=beta, loss_type="davidson", tie_strength=1e-9)
    sig = dpo_loss(a, b, ra, rb, torch.tensor([WIN]), beta=beta, loss_type="sigmoid")
    assert float(tiny_nu.loss[0]) == pytest.approx(float(sig.loss[0]), rel=1e-5)


def test_answer_logprobs_sum_or_mean_and_metrics_count_only_decisive_pairs():
    tok = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert answer_logprobs(tok, mask, "sigmoid").tolist() == [-3.0, -3.0]
    assert answer_logprobs(tok, mask, "ipo").tolist() == [-1.5, -1.0]
    a, b, ra, rb, t = _pair(
        ([-1.0, -3.0, -1.0], [-2.0, -1.0, -1.0], [-1.0] * 3, [-1.0] * 3), [WIN, LOSS, TIE]
    )
    out = dpo_loss(a, b, ra, rb, t, beta=1.0)
    means = mean_metrics(pair_metrics(out, t, a, b))
    # pair 1: a chosen, reward 0 vs -1; pair 2: b chosen, reward 0 vs -2 -> accuracy 1, margin 1.5
    assert means["rewards_accuracy"] == 1.0 and means["rewards_margin"] == pytest.approx(1.5)
    assert means["logps_chosen"] == pytest.approx(-1.0) and means["tie_reward_gap"] == 0.0


def test_bad_settings_are_refused():
    a, b, ra, rb, t = _pair(([-1.0], [-1.0], [-1.0], [-1.0]), [WIN])
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(a, b, ra, rb, t, beta=0.1, loss_type="hinge-ish")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(a, b, ra, rb, t, beta=0.0)
