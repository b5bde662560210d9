"""GRPO maths against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from hpref.rl.algorithms.objectives import (  # noqa: E402
    batch_normalised,
    group_advantages,
    k3_kl,
    leave_one_out_advantages,
    masked_mean,
    policy_loss,
    reinforce_returns,
)
from hpref.rl.logprobs import entropy_metrics, entropy_sums, sequence_logprobs, token_entropy  # noqa: E402


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


# --------------------------------------------------------------------------------------------------
# the grpo algorithm's other estimators (`advantage = "rloo" | "reinforce++"`) and the entropy metric


def test_rloo_subtracts_the_mean_of_the_other_answers_only():
    # Wrong if RLOO's baseline counted the answer itself (GRPO's centring) or divided by a std
    adv = leave_one_out_advantages(torch.tensor([1.0, 3.0, 8.0, 2.0, 2.0, 5.0]), group_size=3)
    # 1 - (3 + 8) / 2, 3 - (1 + 8) / 2, 8 - (1 + 3) / 2 | 2 - (2 + 5) / 2 twice, 5 - (2 + 2) / 2
    assert adv.tolist() == pytest.approx([-4.5, -1.5, 6.0, -1.5, -1.5, 3.0])
    assert leave_one_out_advantages(torch.tensor([4.0, 4.0]), group_size=2).tolist() == [0.0, 0.0]


def test_reinforce_returns_put_the_reward_last_and_the_kl_on_every_token():
    # Wrong if the answer's reward landed on another token than its last, the KL reward were not the
    # clamped k1 of the sampled token, or returns summed the past instead of the future
    rewards = torch.tensor([1.0, -2.0])
    # row 1 is laid out as a `pad_batch` row: its answer starts after a prompt position
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [0.0, -1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [0.0, -13.0, -1.0, 0.0]])
    # log pi_old - log pi_ref: [0.5, -1, 0] and [12 -> clamped to 10, 0]; token rewards -0.1 x that,
    # plus the reward at the last token: [-0.05, 0.1, 1.0] and [-1.0, -2.0]; returns sum the future
    got = reinforce_returns(rewards, mask, old, ref, kl_coef=0.1)
    assert got.tolist() == [pytest.approx(r) for r in ([1.05, 1.1, 1.0, 0.0], [0.0, -3.0, -2.0, 0.0])]
    plain = reinforce_returns(rewards, mask)  # kl_coef 0: plain REINFORCE, every token its reward
    assert plain.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, -2.0, -2.0, 0.0]]


def test_batch_normalisation_is_over_every_token_of_the_step_wherever_it_lies():
    """REINFORCE++ normalises over the rollout: tokens 1, 3, 5 (mean 3, population std sqrt(8/3))
    give -sqrt(3/2), 0, sqrt(3/2) whether they sit in one micro-batch, two, or on two ranks, and a
    group's padding micro-batch is not counted. Wrong if each micro-batch (or rank) were normalised
    on its own: the step would then depend on how the trainer split the rollout."""
    s = math.sqrt(1.5)
    one, spread = batch_normalised(
        [torch.tensor([[1.0, 3.0, 0.0], [5.0, 9.0, 9.0]])], [torch.tensor([[1, 1, 0], [1, 0, 0]])], [True]
    )
    assert one[0].tolist() == [pytest.approx(r, abs=1e-6) for r in ([-s, 0.0, 0.0], [s, 0.0, 0.0])]
    assert spread == pytest.approx({"advantage_std": 1.0, "advantage_min": -s, "advantage_max": s})
    values = [torch.tensor([[1.0, 3.0]]), torch.tensor([[5.0, 7.0]]), torch.tensor([[100.0, 100.0]])]
    masks = [torch.ones(1, 2), torch.tensor([[1.0, 0.0]]), torch.ones(1, 2)]
    split, again = batch_normalised(values, masks, [True, True, False])  # the last: a padding pass
    assert [v.tolist() for v in split[:2]] == [[[pytest.approx(-s), 0.0]], [[pytest.approx(s), 0.0]]]
    assert again == pytest.approx(spread)

    # two ranks, each with its micro-batches: the group's sums and maxima make the same numbers
    ranks = [(values[:1], masks[:1]), (values[1:2], masks[1:2])]
    local = []
    for vals, msks in ranks:
        batch_normalised(vals, msks, [True], lambda sums, maxes: local.append((sums, maxes)) or (sums, maxes))

    def group(sums, maxes):
        return (
            {k: sum(s[k] for s, _ in local) for k in sums},
            {k: max(m[k] for _, m in local) for k in maxes},
        )

    per_rank = [batch_normalised(vals, msks, [True], group) for vals, msks in ranks]
    assert per_rank[0][0][0].tolist() == [[pytest.approx(-s), 0.0]]
    assert per_rank[1][0][0].tolist() == [[pytest.approx(s), 0.0]]
    assert per_rank[0][1] == pytest.approx(spread) and per_rank[1][1] == pytest.approx(spread)


def test_token_entropy_of_known_distributions_in_any_chunking():
    # Wrong if the entropy were of another distribution (no softmax, base 2) or chunks lost rows
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]]
    )
    # uniform over 4: ln 4; (1/2, 1/4, 1/8, 1/8): (1/2 + 2/4 + 6/8) ln 2 = 1.75 ln 2
    expected = [math.log(4.0), 1.75 * math.log(2.0)]
    assert token_entropy(logits).tolist() == pytest.approx(expected, abs=1e-6)
    assert token_entropy(logits, chunk_elements=4).tolist() == pytest.approx(expected, abs=1e-6)
    wide = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 3
    want = torch.distributions.Categorical(logits=wide).entropy()
    torch.testing.assert_close(token_entropy(wide, chunk_elements=100), want, atol=1e-5, rtol=1e-5)
    assert not token_entropy(wide.requires_grad_()).requires_grad


def test_entropy_sums_count_the_policys_own_answer_tokens_only():
    # Wrong if padding, prompt positions or an opponent's answer (a cross-policy pair) counted
    entropy = torch.tensor([[0.1, 0.9, 5.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    sums = entropy_sums(entropy, mask)  # 0.1, 0.9, 0.5: two below LOW_ENTROPY_NATS (0.672)
    assert sums == pytest.approx({"entropy_sum": 1.5, "entropy_low_tokens": 2.0, "entropy_tokens": 3.0})
    own = entropy_sums(entropy, mask, rows=[4, 7], sampled=[True] * 7 + [False])  # row 7: a rival's
    assert own == pytest.approx({"entropy_sum": 1.0, "entropy_low_tokens": 1.0, "entropy_tokens": 2.0})
    assert entropy_metrics(sums) == pytest.approx({"entropy": 0.5, "low_entropy_share": 2 / 3})
    assert entropy_metrics({}) == {"entropy": 0.0, "low_entropy_share": 0.0}
