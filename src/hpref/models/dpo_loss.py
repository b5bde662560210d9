"""The DPO family's objective, as pure torch functions: offline DPO (`hpref train` with `[dpo]`) and
online DPO (`hpref rl` with `algorithm = "online-dpo"`) both call `dpo_loss`, so they cannot drift.

A pair is two answers `a`, `b` to one prompt with a label over the three outcomes
`targets [N, 3] = (P(a preferred), P(b preferred), P(tie))`: one-hot for a chosen/rejected pair
(`a` = chosen), a tie for an arena tie, soft for a judge's three-way verdict. Each answer's
*implicit reward* is `beta * (log pi(answer) - log pi_ref(answer))` (Rafailov et al., 2023), its
log-probabilities summed over the answer's tokens (averaged for IPO, as TRL and the IPO paper do).

Loss types (`loss_type`):
  sigmoid   DPO's Bradley-Terry loss, `-log sigmoid(r_a - r_b)`, with TRL's label smoothing
            (conservative DPO, Mitchell 2023). A tie counts as half a win each way, so its loss is
            least where the two rewards are equal: a tie pulls them together instead of being dropped.
  ipo       IPO's squared loss (Azar et al., 2023): the log-ratio margin regressed to `1 / (2 beta)`
            for a win, `-1 / (2 beta)` for a loss and 0 for a tie (the label's expectation).
  davidson  tie-aware DPO, DPO-D of Chen et al., 2024 ("On Extending Direct Preference Optimisation to
            Accommodate Ties"): Davidson's model with ties on the implicit rewards,
            P(a) : P(b) : P(tie) = e^{r_a} : e^{r_b} : nu e^{(r_a + r_b) / 2}, and the cross-entropy of
            the three outcomes — the same head (`models.heads.davidson_logits`) hpref's reward models
            are trained with. A win pushes the rewards apart; a tie pulls them together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import get_args

import torch
import torch.nn.functional as F

from hpref.models.heads import davidson_logits
from hpref.models.loss import soft_cross_entropy
from hpref.recipe.dpo import LossType

LOSS_TYPES: tuple[str, ...] = get_args(LossType)

#: the outcomes of a pair's label, in `targets`' column order
A_WINS, B_WINS, TIE = 0, 1, 2


@dataclass
class DpoLoss:
    """Per-pair losses (to be weighted and summed by the caller) and detached statistics."""

    loss: torch.Tensor  # [N]
    reward_a: torch.Tensor  # [N] implicit rewards, detached
    reward_b: torch.Tensor  # [N]


def length_normalised(loss_type: str) -> bool:
    """Whether `loss_type` takes each answer's mean token log-probability instead of the sum (IPO)."""
    return loss_type == "ipo"


def answer_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """`[N, T]` log-probs of each answer's tokens (mask 1 on the answer) -> `[N]`, summed (or averaged
    for IPO: `length_normalised`)."""
    mask = mask.to(token_logprobs.dtype)
    total = (token_logprobs * mask).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1.0) if length_normalised(loss_type) else total


def smooth_targets(targets: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """cDPO's label noise: a share `label_smoothing` of each decisive label moves to the opposite
    outcome (a tie is its own opposite, so it is unchanged)."""
    if not label_smoothing:
        return targets
    swapped = targets[:, [B_WINS, A_WINS, TIE]]
    return (1.0 - label_smoothing) * targets + label_smoothing * swapped


def dpo_loss(
    logps_a: torch.Tensor,
    logps_b: torch.Tensor,
    ref_logps_a: torch.Tensor,
    ref_logps_b: torch.Tensor,
    targets: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    tie_strength: float = 1.0,
) -> DpoLoss:
    """The per-pair loss of `loss_type` (module docstring). `logps_*`: `[N]` answer log-probs under the
    policy (with gradient) and the reference; `targets`: `[N, 3]` rows summing to 1; `tie_strength`:
    Davidson's nu (P(tie) at equal rewards is nu / (2 + nu): 1/3 at the default 1)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if targets.ndim != 2 or targets.shape[1] != 3 or targets.shape[0] != logps_a.shape[0]:
        raise ValueError(f"targets must be [{logps_a.shape[0]}, 3], got {tuple(targets.shape)}")
    ratio_a = logps_a.float() - ref_logps_a.float()
    ratio_b = logps_b.float() - ref_logps_b.float()
    targets = smooth_targets(targets.float(), label_smoothing)
    if loss_type == "sigmoid":
        margin = beta * (ratio_a - ratio_b)
        wins_a = targets[:, A_WINS] + 0.5 * targets[:, TIE]
        loss = -wins_a * F.logsigmoid(margin) - (1.0 - wins_a) * F.logsigmoid(-margin)
    elif loss_type == "ipo":
        goal = (targets[:, A_WINS] - targets[:, B_WINS]) / (2.0 * beta)
        loss = (ratio_a - ratio_b - goal) ** 2
    elif loss_type == "davidson":
        if tie_strength <= 0:
            raise ValueError(f"tie_strength must be > 0, got {tie_strength}")
        scores = torch.stack([beta * ratio_a, beta * ratio_b], dim=1).reshape(-1)
        log_nu = torch.tensor(math.log(tie_strength), device=scores.device)
        loss = soft_cross_entropy(davidson_logits(scores, log_nu), targets)
    else:
        raise ValueError(f"unknown loss_type '{loss_type}' (one of {', '.join(LOSS_TYPES)})")
    return DpoLoss(loss, (beta * ratio_a).detach(), (beta * ratio_b).detach())


def pair_metrics(out: DpoLoss, targets: torch.Tensor, logps_a: torch.Tensor, logps_b: torch.Tensor) -> dict:
    """TRL's DPO metrics, as sums over the pairs (the caller divides by its counts, so micro-batches
    and ranks add up): on decisive pairs (chosen = the preferred answer) the chosen and rejected
    rewards, their margin, the accuracy of the implicit rewards and the chosen/rejected log-probs; on
    ties the mean |r_a - r_b|. Keys ending in `_n` are the counts."""
    decisive = targets[:, TIE] < 0.5
    a_chosen = targets[:, A_WINS] >= targets[:, B_WINS]
    chosen = torch.where(a_chosen, out.reward_a, out.reward_b)[decisive]
    rejected = torch.where(a_chosen, out.reward_b, out.reward_a)[decisive]
    logp_c = torch.where(a_chosen, logps_a.detach(), logps_b.detach())[decisive].float()
    logp_r = torch.where(a_chosen, logps_b.detach(), logps_a.detach())[decisive].float()
    ties = ~decisive
    return {
        "loss": float(out.loss.detach().sum()),
        "pairs_n": float(out.loss.numel()),
        "rewards_chosen": float(chosen.sum()),
        "rewards_rejected": float(rejected.sum()),
        "rewards_margin": float((chosen - rejected).sum()),
        "rewards_accuracy": float((chosen > rejected).float().sum()),
        "logps_chosen": float(logp_c.sum()),
        "logps_rejected": float(logp_r.sum()),
        "decisive_n": float(decisive.sum()),
        "tie_reward_gap": float((out.reward_a - out.reward_b).abs()[ties].sum()),
        "ties_n": float(ties.sum()),
    }


def mean_metrics(sums: dict[str, float]) -> dict[str, float]:
    """`pair_metrics` sums (added over micro-batches and ranks) -> means: the loss over every pair, the
    chosen/rejected figures over decisive pairs, the tie gap over ties (absent without ties)."""
    pairs, decisive, ties = sums.get("pairs_n", 0.0), sums.get("decisive_n", 0.0), sums.get("ties_n", 0.0)
    out = {"loss": sums["loss"] / max(pairs, 1.0)}
    if decisive:
        for key in ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"):
            out[key] = sums[key] / decisive
        out["logps_chosen"] = sums["logps_chosen"] / decisive
        out["logps_rejected"] = sums["logps_rejected"] / decisive
    if ties:
        out["tie_reward_gap"] = sums["tie_reward_gap"] / ties
    return out
