"""GRPO as an `hpref.rl.protocols.Algorithm` (`algorithm = "grpo"`, every policy's default): a
policy-gradient step of the clipped surrogate on advantages from one of three estimators (its
`advantage`; `hpref.rl.algorithms.objectives` holds the numbers):

- `grpo`: group-normalised (each reward less its group's mean, over its group's std), with an
  in-loss k3 KL to the start at `kl_coef`; `scale_by_std = false` is Dr. GRPO.
- `rloo`: each reward less the mean of its group's other answers (Ahmadian et al. 2024), no std
  scaling; the KL as GRPO's.
- `reinforce++`: REINFORCE++ (Hu 2025) as OpenRLHF implements it (`--advantage_estimator
  reinforce`): the KL to the start is in the reward, token by token (k1 of the sampled token,
  `-kl_coef x (log pi_old - log pi_ref)`, the answer's reward at its last token), the returns are
  reverse cumulative sums (gamma 1), and the advantages are those returns normalised over every
  answer token of the rollout (all micro-batches, all ranks of a group: `prepare_batches`). No
  in-loss KL term. `kl_coef = 0` is allowed, as there: plain batch-normalised REINFORCE, which needs
  no reference.

Its settings are its algorithm table's (`GrpoConfig`: `algorithm = { name = "grpo", kl_coef = 0.04,
advantage = "rloo" }`), as every algorithm's are; a plain `algorithm = "grpo"` keeps the defaults.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hpref.rl.rollout_types import Rollout, TrainingRows

if TYPE_CHECKING:
    import torch

    from hpref.recipe.rl import PolicyConfig, RLConfig
    from hpref.rl.algorithms.objectives import StatsReduce


class GrpoConfig(BaseModel):
    """GRPO's settings, `rl.policies.<id>.algorithm = { name = "grpo", ... }` (or `[rl.defaults]`'s).
    The same keys in a policy's own table, where they were before, are refused in one line that
    says where each went (`hpref.recipe.rl_policy.GRPO_KEYS`)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    clip_low: float = Field(0.2, ge=0, lt=1, description="lower clip: ratios below 1 - clip_low are clipped")
    clip_high: float = Field(0.28, ge=0, description="upper clip: ratios above 1 + clip_high are clipped")
    kl_coef: float = Field(
        0.0, ge=0, description="KL weight to the start (0 = off): k3 in the loss; reinforce++: k1 in reward"
    )
    measure_kl: bool = Field(
        False,
        description="keep a frozen copy of the start to report the KL to it even when kl_coef = 0 "
        "(costs one reference forward pass per rollout); without either, `kl` is reported as 0",
    )
    scale_by_std: bool = Field(True, description="divide advantages by the group std (false = Dr. GRPO)")
    advantage: Literal["grpo", "rloo", "reinforce++"] = Field(
        "grpo",
        description="the advantage estimator: grpo (group-normalised, scale_by_std), rloo (reward less the "
        "mean of its group's other answers), reinforce++ (kl_coef's KL in a per-token reward, returns "
        "normalised over the rollout's tokens, no KL term in the loss)",
    )
    aggregation: Literal["token-mean", "sequence-mean"] = Field(
        "token-mean", description="how token losses are averaged"
    )
    turn_advantages: bool = Field(
        True,
        description="multi-turn episodes (grpo, rloo): each turn its own advantage, its reward-to-go "
        "compared with the same turn of the start's other episodes (AT-GRPO's per-turn groups); false: "
        "one advantage per episode, every turn alike",
    )


class Grpo:
    name = "grpo"
    needs_preferences = False
    cross_policy = False

    def __init__(self, config: GrpoConfig, policy: PolicyConfig) -> None:
        self.config = config

    def check(self, policy: str, config: RLConfig, policies: list[str], where: str) -> None:
        return None  # GrpoConfig's fields are checked when the recipe is read

    def wants_reference(self) -> bool:
        # REINFORCE++ reads the reference only for its KL reward: at kl_coef 0 it needs none either
        return self.config.kl_coef > 0 or self.config.measure_kl

    def prepare(self, rollout: Rollout, tokenizer: Any) -> TrainingRows:
        """The rollout's rows; `values`: an advantage per answer (grpo, rloo), or the raw rewards that
        `prepare_batches` turns into per-token advantages (reinforce++)."""
        import torch

        from hpref.rl.algorithms.objectives import (
            advantage_spread,
            group_advantages,
            leave_one_out_advantages,
            turn_advantages,
        )

        rewards = torch.tensor(rollout.rewards, dtype=torch.float32)
        estimator = self.config.advantage
        turns = self.turns_of(rollout)
        if turns is not None:  # [rows, turns]: the batches spread them over the turns' tokens
            values = turn_advantages(
                rewards,
                turns,
                rollout.group_size,
                leave_one_out=estimator == "rloo",
                scale_by_std=self.config.scale_by_std,
            )
            took = torch.tensor([[k < len(t) for k in range(values.shape[1])] for t in turns])
            spread = advantage_spread(values[took])
        elif estimator == "grpo":
            values = group_advantages(rewards, rollout.group_size, scale_by_std=self.config.scale_by_std)
        elif estimator == "rloo":
            values = leave_one_out_advantages(rewards, rollout.group_size)
        else:
            values = rewards
        if turns is None:
            spread = advantage_spread(values) if estimator != "reinforce++" else {}
        return TrainingRows(
            prompts=rollout.prompt_ids,
            completions=rollout.completions,
            group=rollout.group_size,
            behaviour=rollout.logprobs,
            temperature=rollout.temperature,
            values=values,
            metrics=spread,
            masks=rollout.masks,  # an episode's observations are context, never trained on
        )

    def turns_of(self, rollout: Rollout) -> list[list[float]] | None:
        """Each row's own turns' rewards, where advantages go per turn (`turn_advantages`): episodes
        some row of which took several turns, under grpo or rloo; else None (one per answer)."""
        episodes = rollout.episodes
        if not self.config.turn_advantages or self.config.advantage == "reinforce++" or episodes is None:
            return None
        turns = episodes.turn_steps
        return turns if turns is not None and any(len(t) > 1 for t in turns) else None

    def prepare_batches(
        self, batches: list[dict[str, Any]], prepared: TrainingRows, reduce: StatsReduce
    ) -> None:
        """Per-token advantages (`batch["advantages"]`, `hpref.rl.protocols.PreparesBatches`): per turn
        (`turn_advantages`: each turn's tokens its turn's value), or REINFORCE++'s, from the returns of
        its rows normalised over the whole step; the other estimators have theirs per answer already."""
        if prepared.values is not None and prepared.values.ndim == 2:
            from hpref.rl.algorithms.objectives import token_turn_values

            for batch in batches:
                batch["advantages"] = token_turn_values(prepared.values[batch["rows"]], batch["mask"])
            return
        if self.config.advantage != "reinforce++":
            return
        from hpref.rl.algorithms.objectives import batch_normalised, reinforce_returns

        returns = [
            reinforce_returns(
                prepared.values[batch["rows"]],
                batch["mask"],
                batch.get("old"),
                batch.get("ref"),
                self.config.kl_coef,
            )
            for batch in batches
        ]
        counted = [not batch.get("padding") for batch in batches]
        advantages, spread = batch_normalised(returns, [b["mask"] for b in batches], counted, reduce)
        for batch, values in zip(batches, advantages, strict=True):
            batch["advantages"] = values
        prepared.metrics.update(spread)

    def loss(
        self, logprobs: torch.Tensor, batch: dict[str, Any], rows: list[int], prepared: TrainingRows
    ) -> tuple[torch.Tensor, dict[str, float]]:
        from hpref.rl.algorithms.objectives import policy_loss

        cfg = self.config
        mask = batch["mask"]
        # REINFORCE++'s advantages are per token and its KL is in them; per turn too (episodes); the
        # others' per answer
        in_reward = cfg.advantage == "reinforce++"
        per_token = "advantages" in batch
        out = policy_loss(
            logprobs,
            batch["old"],
            batch["advantages"] if per_token else prepared.values[rows].to(logprobs.device),
            mask,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            ref_logprobs=batch["ref"],
            kl_coef=0.0 if in_reward else cfg.kl_coef,
            aggregation=cfg.aggregation,
        )
        tokens = float(mask.sum())
        total_tokens = max(prepared.trained_tokens(), 1)
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
    """GRPO on a reward per answer (advantage: grpo, rloo or reinforce++; kl_coef, clip_low, ...).

    Its settings are the `GrpoConfig` above (`scale_by_std = false` is Dr. GRPO); the policy's
    `epochs_per_rollout` applies as to every algorithm."""
    return Grpo(config, policy)
