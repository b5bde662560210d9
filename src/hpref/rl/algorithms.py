"""The numbers of GRPO, as small pure torch functions the trainer actor calls and tests check.

Shapes: a batch is `B` sampled completions, `B = groups x group_size`, each completion padded to `T`
tokens; `mask [B, T]` is 1 on completion tokens the policy produced and 0 on padding (and on prompt
tokens, which are never trained on). Log-probabilities are of the sampled token at each position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token-mean", "sequence-mean"]


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


def sequence_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token: `logits [B, T, V]` predicting `tokens [B, T]` (already
    shifted: `logits[:, t]` is the distribution the model gave `tokens[:, t]`). Computed in float32
    with log_softmax + gather, never materialising probabilities."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
