"""GRPO maths against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hpref.rl.algorithms import group_advantages, k3_kl, masked_mean, policy_loss, sequence_logprobs  # noqa: E402


def test_group_advantages_normalise_within_each_group_only():
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0, 0.0, 2.0])
    adv = group_advantages(rewards, group_size=2)
    # group [1, 3]: mean 2, unbiased std sqrt(2) -> -1/sqrt(2), +1/sqrt(2); equal group -> 0 (not NaN)
    s = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([-s, s, 0.0, 0.0, -s, s], abs=1e-5)


def test_group_advantages_without_std_is_centring():
    adv = group_advantages(torch.tensor([1.0, 2.0, 6.0]), group_size=3, scale_by_std=False)
    assert adv.tolist() == pytest.approx([-2.0, -1.0, 3.0])


def test_group_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_k3_is_zero_at_equal_policies_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    assert k3_kl(logp, logp).tolist() == [0.0, 0.0, 0.0]
    ref = torch.tensor([-1.5, -1.0, -0.5])
    # log_ratio = ref - logp = [-0.5, 1, 0]: e^x - x - 1
    expected = [math.exp(-0.5) + 0.5 - 1, math.e - 2, 0.0]
    assert k3_kl(logp, ref).tolist() == pytest.approx(expected, abs=1e-6)


def test_masked_mean_token_vs_sequence():
    values = torch.tensor([[1.0, 1.0, 1.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # token-mean: (1+1+1+4)/4; sequence-mean: (1 + 4)/2; padding (9s) never counts
    assert masked_mean(values, mask, "token-mean").item() == pytest.approx(7 / 4)
    assert masked_mean(values, mask, "sequence-mean").item() == pytest.approx(2.5)
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_policy_loss_on_policy_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    adv = torch.tensor([1.0, -3.0])
    mask = torch.ones_like(logp)
    out = policy_loss(logp, logp.clone(), adv, mask)
    # ratio 1 everywhere: loss = -mean over tokens of A = -(1 + 1 - 3 - 3) / 4
    assert out.loss.item() == pytest.approx(1.0)
    assert out.clip_fraction.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)


def test_policy_loss_clip_is_asymmetric():
    # ratios e^0.3 = 1.35 (above both 1.2 and 1.28) and e^-0.3 = 0.74 (below 0.8)
    old = torch.zeros(4, 1)
    logp = torch.tensor([[0.3], [0.3], [-0.3], [-0.3]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out = policy_loss(logp, old, adv, torch.ones_like(old), clip_low=0.2, clip_high=0.28)
    r_hi, r_lo = math.exp(0.3), math.exp(-0.3)
    # per token -min(rA, clip(r)A): A>0,r high -> -1.28; A<0,r high -> +r_hi; A>0,r low -> -r_lo;
    # A<0,r low -> +0.8. Only the first and last are clipped (their gradient is cut).
    expected = (-1.28 + r_hi - r_lo + 0.8) / 4
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.5)


def test_clipped_tokens_get_no_gradient_and_masked_tokens_none():
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.5, 0.0], [0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = policy_loss(logp, old, torch.tensor([1.0, 1.0]), mask)
    out.loss.backward()
    grad = logp.grad.tolist()
    assert grad[0][0] == 0.0  # ratio e^0.5 > 1.28 with A > 0: clipped
    assert grad[1][1] == 0.0  # masked out
    assert grad[0][1] == pytest.approx(-1 / 3)  # d(-r A)/dlogp = -r A / n_tokens at r = 1


def test_kl_term_is_added_with_its_coefficient():
    logp = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0]])
    mask = torch.ones_like(logp)
    base = policy_loss(logp, logp, torch.tensor([0.0]), mask)
    with_kl = policy_loss(logp, logp, torch.tensor([0.0]), mask, ref_logprobs=ref, kl_coef=0.5)
    kl = (math.exp(-1) + 1 - 1 + 0.0) / 2
    assert with_kl.kl.item() == pytest.approx(kl, abs=1e-6)
    assert with_kl.loss.item() - base.loss.item() == pytest.approx(0.5 * kl, abs=1e-6)


def test_sequence_logprobs_gathers_the_sampled_token():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(4.0), 0.0]]])
    tokens = torch.tensor([[1, 1]])
    assert sequence_logprobs(logits, tokens)[0].tolist() == pytest.approx([math.log(0.75), math.log(0.2)])
