"""The numbers of the `grpo` algorithm (its advantage estimators: GRPO, RLOO, REINFORCE++; the
clipped surrogate) and the k3 KL online DPO shares, as small pure torch functions the algorithms call
and tests check (the token log-probs and entropy every room uses are `hpref.rl.logprobs`).

Shapes: a batch is `B` sampled completions, `B = groups x group_size`, each completion padded to `T`
tokens; `mask [B, T]` is 1 on completion tokens the policy produced and 0 on padding (and on prompt
tokens, which are never trained on). Log-probabilities are of the sampled token at each position.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "sequence-mean"]

#: sums and maxima of per-rank statistics over a trainer group's data ranks (`hpref.rl.trainer.sharding.
#: reduce_stats`), or the statistics as they are on one data rank
StatsReduce = Callable[[dict[str, float], dict[str, float]], tuple[dict[str, float], dict[str, float]]]

#: OpenRLHF clamps the per-token log-ratio of REINFORCE++'s KL reward to this range: one token far
#: off its reference cannot swamp an answer's return
KL_REWARD_CLAMP = 10.0


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std.

    `rewards [B]` holds `B / group_size` consecutive groups of answers to one prompt each. A group
    whose answers all scored the same carries no signal and gets advantage 0 (not NaN). The std is
    the unbiased one, as in the GRPO paper and TRL; `scale_by_std=False` gives Dr. GRPO's
    mean-only centring, which does not up-weight groups that happen to have nearly equal rewards.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages (Ahmadian et al. 2024): each reward minus the mean of the other answers to its
    prompt, `G / (G - 1) x (r - group mean)`; no std scaling. The baseline leaves the answer out, so
    it does not depend on the answer it judges and the estimate is unbiased. `rewards [B]` as in
    `group_advantages`; a group of one has no other answer and gets 0."""
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    centred = group_advantages(rewards, group_size, scale_by_std=False)
    return centred * (group_size / (group_size - 1))


def turn_advantages(
    rewards: torch.Tensor,
    steps: list[list[float]],
    group_size: int,
    *,
    leave_one_out: bool = False,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-turn advantages `[B, K]` of multi-turn episodes (K: the most turns of any row; 0 past a
    row's last turn), grouped per turn position (AT-GRPO's per-turn groups, over the episodes of one
    start). A turn's return is its reward-to-go, `rewards[i]` less the per-turn rewards of the row's
    earlier turns (`steps[i]`: each own turn's `Step.reward`; `rewards[i]` holds the episode's reward
    plus all of them): a turn is credited with what came at and after it, never before. Turn k of a
    row is compared with turn k of the group's rows that have one, as `group_advantages` (or
    `leave_one_out_advantages`) compares answers: both baselines depend on the position alone, not
    on the turn, so the estimate stays unbiased. Rows of equal turns and no per-turn rewards get
    `group_advantages`' values at every turn."""
    import torch

    if rewards.ndim != 1 or len(steps) != rewards.numel():
        raise ValueError(f"{len(steps)} rows of turn rewards for rewards of shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    width = max((len(t) for t in steps), default=0)
    returns = torch.zeros((len(steps), max(width, 1)), dtype=torch.float64)
    present = torch.zeros_like(returns, dtype=torch.bool)
    for i, turns in enumerate(steps):
        earlier = 0.0
        for k, reward in enumerate(turns):
            returns[i, k] = float(rewards[i]) - earlier
            present[i, k] = True
            earlier += reward
    out = torch.zeros_like(returns)
    for start in range(0, len(steps), group_size):
        for k in range(width):
            rows = [i for i in range(start, start + group_size) if present[i, k]]
            if len(rows) < 2:
                continue  # a turn no other episode of the start reached: nothing to compare it with
            values = returns[rows, k].float()
            centred = values - values.mean()
            if leave_one_out:
                centred = centred * (len(rows) / (len(rows) - 1))
            elif scale_by_std:
                centred = centred / (values.std() + eps)
            out[rows, k] = centred.double()
    return out.float()


def token_turn_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values [B, K]` (one per turn of each row) spread over `mask [B, T]`'s tokens: a row's turns
    are its runs of 1s, in order (observations, 0s, between them), each token taking its turn's
    value; 0 off the mask."""
    import torch

    on = mask > 0
    before = torch.zeros_like(on)
    before[:, 1:] = on[:, :-1]
    turn = torch.cumsum((on & ~before).long(), dim=1) - 1
    turn = turn.clamp(0, values.shape[1] - 1)
    return torch.gather(values.to(mask.device, torch.float32), 1, turn) * on


def reinforce_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """REINFORCE++'s per-token returns `[B, T]` (Hu 2025, as OpenRLHF's `compute_reward` and
    `get_cumulative_returns` compute them): each answer token is rewarded `-kl_coef x (log pi_old -
    log pi_ref)` of its sampled token (the k1 estimate, clamped to +-`KL_REWARD_CLAMP`), its last
    token also gets the answer's reward `rewards [B]`, and a token's return is the sum of its own
    and every later token's reward (gamma 1). Without a reference or with `kl_coef` 0 every token
    of an answer returns its reward. Zero off the mask."""
    mask = mask.float()
    token_rewards = torch.zeros_like(mask)
    if kl_coef and old_logprobs is not None and ref_logprobs is not None:
        log_ratio = (old_logprobs.float() - ref_logprobs.float()).clamp(-KL_REWARD_CLAMP, KL_REWARD_CLAMP)
        token_rewards = -kl_coef * log_ratio * mask
    # the last answer token of each row (a row with none puts it on a masked column, which is dropped)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1, keepdim=True)
    token_rewards = token_rewards.scatter_add(1, last, rewards.float().to(mask.device)[:, None])
    returns = token_rewards.flip(1).cumsum(1).flip(1)
    return returns * mask


def batch_normalised(
    values: list[torch.Tensor],
    masks: list[torch.Tensor],
    counted: list[bool],
    reduce: StatsReduce | None = None,
    eps: float = 1e-8,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """REINFORCE++'s advantages: a step's per-token `values` (one `[b, T]` tensor per micro-batch)
    less their mean over every masked token of the step, over their std (the population one, its
    variance floored at `eps`), as OpenRLHF whitens advantages over the whole rollout batch. The
    mean and std are of the micro-batches `counted` (not a group's padding ones) on every rank
    (`reduce`; None on one), so they do not depend on how the rows are split. Returns the
    advantages (zero off the mask) and their spread: `advantage_std`, `advantage_min`,
    `advantage_max` over those tokens."""
    mine = [(v.double(), m.bool()) for v, m, keep in zip(values, masks, counted, strict=True) if keep]
    picked = [v[m] for v, m in mine]
    sums = {
        "tokens": float(sum(p.numel() for p in picked)),
        "sum": float(sum(p.sum() for p in picked)),
        "squares": float(sum((p * p).sum() for p in picked)),
    }
    maxes = {
        "max": max((float(p.max()) for p in picked if p.numel()), default=-math.inf),
        "neg_min": max((-float(p.min()) for p in picked if p.numel()), default=-math.inf),
    }
    sums, maxes = reduce(sums, maxes) if reduce is not None else (sums, maxes)
    if not sums["tokens"]:
        zero = {"advantage_std": 0.0, "advantage_min": 0.0, "advantage_max": 0.0}
        return [torch.zeros_like(v, dtype=torch.float32) for v in values], zero
    mean = sums["sum"] / sums["tokens"]
    var = max(sums["squares"] / sums["tokens"] - mean * mean, 0.0)  # summed in float64: exact enough
    scale = 1.0 / math.sqrt(max(var, eps))
    out = [((v.double() - mean) * scale * m).float() for v, m in zip(values, masks, strict=True)]
    spread = {
        "advantage_std": math.sqrt(var) * scale,
        "advantage_min": (-maxes["neg_min"] - mean) * scale,
        "advantage_max": (maxes["max"] - mean) * scale,
    }
    return out, spread


def advantage_spread(advantages: torch.Tensor) -> dict[str, float]:
    """The spread of one advantage per answer (GRPO, RLOO): the std over the rollout's answers
    (unbiased; groups whose answers all scored alike pull it below 1 under GRPO's scaling), min, max."""
    return {
        "advantage_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "advantage_min": float(advantages.min()) if advantages.numel() else 0.0,
        "advantage_max": float(advantages.max()) if advantages.numel() else 0.0,
    }


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference): `e^(ref - logp) - (ref - logp) - 1`.

    Unbiased for samples drawn from the policy, and never negative (unlike the plain `logp - ref`),
    so a batch mean cannot hide large divergences behind cancelling signs (Schulman's "k3").
    """
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation = "token-mean"
) -> torch.Tensor:
    """Mean over masked tokens: every token counts once (`token-mean`, DAPO's choice, so long answers
    are not down-weighted), or each sequence's mean counts once (`sequence-mean`, the GRPO paper's).
    A batch with no unmasked token gives 0, not NaN."""
    mask = mask.to(values.dtype)
    if aggregation == "token-mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    if aggregation == "sequence-mean":
        per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        has_tokens = (mask.sum(dim=1) > 0).to(values.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    raise ValueError(f"unknown aggregation '{aggregation}'")


@dataclass
class PolicyLoss:
    """The loss to back-propagate and detached statistics for the metrics."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor  # mean k3 estimate over masked tokens (0 when no reference is given)
    clip_fraction: torch.Tensor  # share of masked tokens whose gradient the clip removed
    ratio_mean: torch.Tensor


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: Aggregation = "token-mean",
) -> PolicyLoss:
    """The clipped surrogate with an asymmetric clip range `[1 - clip_low, 1 + clip_high]`.

    `logprobs`, `old_logprobs`, `ref_logprobs`: `[B, T]`; `advantages`: `[B]` (one per completion,
    broadcast to its tokens) or `[B, T]`. A wider upper clip ("clip-higher", DAPO) lets unlikely
    tokens with positive advantage grow faster, which keeps exploration alive. With a reference and
    `kl_coef > 0` the per-token k3 KL is added to the loss (GRPO's in-loss KL, not a reward penalty).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same shape"
        )
    if clip_low < 0 or clip_high < 0:
        raise ValueError("clip ranges must be >= 0")
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    surrogate = masked_mean(per_token, mask, aggregation)
    if ref_logprobs is not None:
        kl = masked_mean(k3_kl(logprobs, ref_logprobs), mask, aggregation)
    else:
        kl = torch.zeros((), dtype=surrogate.dtype, device=surrogate.device)
    loss = surrogate + kl_coef * kl if kl_coef else surrogate
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
        clip_fraction = masked_mean(was_clipped.to(ratio.dtype), mask, "token-mean")
        ratio_mean = masked_mean(ratio, mask, "token-mean")
    return PolicyLoss(loss, surrogate.detach(), kl.detach(), clip_fraction, ratio_mean)
