"""GRPO as an `hpref.rl.protocols.Algorithm` (`algorithm = "grpo"`, every policy's default): group-
normalised advantages and the clipped surrogate with an in-loss k3 KL (`hpref.rl.algorithms` holds
the numbers). Its settings are the policy's own keys (`clip_low`, `clip_high`, `kl_coef`,
`measure_kl`, `scale_by_std`, `aggregation`), as before algorithms were components.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from hpref.rl.rollout_types import Rollout, TrainingRows

if TYPE_CHECKING:
    import torch

    from hpref.recipe.rl import PolicyConfig, RLConfig


class GrpoConfig(BaseModel):
    """GRPO takes its settings from the policy's keys (`clip_low`, `kl_coef`, ...): none here."""

    model_config = ConfigDict(extra="forbid")


class Grpo:
    name = "grpo"
    needs_preferences = False
    cross_policy = False

    def __init__(self, config: GrpoConfig, policy: PolicyConfig) -> None:
        self.policy = policy

    def check(self, policy: str, config: RLConfig, policies: list[str], where: str) -> None:
        return None  # the policy's GRPO keys are checked with the recipe

    def wants_reference(self) -> bool:
        return self.policy.kl_coef > 0 or self.policy.measure_kl

    def prepare(self, rollout: Rollout, tokenizer: Any) -> TrainingRows:
        import torch

        from hpref.rl.algorithms import group_advantages

        rewards = torch.tensor(rollout.rewards, dtype=torch.float32)
        advantages = group_advantages(rewards, rollout.group_size, scale_by_std=self.policy.scale_by_std)
        return TrainingRows(
            prompts=rollout.prompt_ids,
            completions=rollout.completions,
            group=rollout.group_size,
            behaviour=rollout.logprobs,
            temperature=rollout.temperature,
            values=advantages,
        )

    def loss(
        self, logprobs: torch.Tensor, batch: dict[str, Any], rows: list[int], prepared: TrainingRows
    ) -> tuple[torch.Tensor, dict[str, float]]:
        from hpref.rl.algorithms import policy_loss

        cfg = self.policy
        mask = batch["mask"]
        out = policy_loss(
            logprobs,
            batch["old"],
            prepared.values[rows].to(logprobs.device),
            mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            ref_logprobs=batch["ref"],
            kl_coef=cfg.kl_coef,
            aggregation=cfg.aggregation,
        )
        tokens = float(mask.sum())
        total_tokens = max(sum(len(c) for c in prepared.completions), 1)
        # the micro-batch's share of the step: of its tokens (token-mean) or of its answers
        weight = (
            tokens / total_tokens
            if cfg.aggregation == "token-mean"
            else len(rows) / len(prepared.completions)
        )
        share = tokens / total_tokens  # the statistics are token means
        stats = {
            "loss": float(out.loss.detach()) * weight,
            "kl": float(out.kl) * share,
            "clip_fraction": float(out.clip_fraction) * share,
            "ratio_mean": float(out.ratio_mean) * share,
        }
        return out.loss * weight, stats

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        return {key: sums.get(key, 0.0) for key in ("loss", "kl", "clip_fraction", "ratio_mean")}


def build_grpo(config: GrpoConfig, policy: PolicyConfig) -> Grpo:
    """GRPO on a reward per answer; set by the policy's keys (clip_low, clip_high, kl_coef, scale_by_std).

    `scale_by_std = false` is Dr. GRPO; `measure_kl`, `aggregation` and `epochs_per_rollout` too."""
    return Grpo(config, policy)
