"""The rewards an `hpref rl` run trains on, read from its `[rl]` section: `[rl.reward]` alone, or
several `[rl.rewards.<name>]` with weights (`hpref.rl.rollout.rewards` scores them), as one list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpref.recipe.rl import RLConfig, resolve_rl_components
from hpref.recipe.rl_components import RewardSection


@dataclass(frozen=True)
class RewardPart:
    """One reward the policies train on: `[rl.reward]` (named "reward", weight 1) or one of
    `[rl.rewards.<name>]`, with its registered component's validated config."""

    name: str
    key: str  # the recipe's dotted key, for messages: rl.reward or rl.rewards.<name>
    section: RewardSection
    config: Any
    weight: float


def reward_parts(config: RLConfig) -> list[RewardPart]:
    """The rewards the policies train on, in recipe order (`resolve_rl_components` validates them)."""
    if config.reward_config is None and config.rewards_config is None:
        resolve_rl_components(config)
    if config.rewards is None:
        return [RewardPart("reward", "rl.reward", config.reward, config.reward_config, 1.0)]
    return [
        RewardPart(name, f"rl.rewards.{name}", section, config.rewards_config[name], section.weight)
        for name, section in config.rewards.items()
    ]


def rl_rewards(config: RLConfig) -> dict[str, Any]:
    """The validated configs of the run's rewards by dotted key: `rl.reward` (or each `rl.rewards.<name>`),
    and `rl.eval_scorer` when set (`resolve_rl_components` fills them)."""
    out = {part.key: part.config for part in reward_parts(config)}
    if config.eval_scorer is not None:
        out["rl.eval_scorer"] = config.eval_scorer_config
    return out


def pair_judging_fault(config: RLConfig) -> tuple[RewardPart, str] | None:
    """The first reward part that cannot give verdicts on answer pairs, with why: `"pairs"`, its
    config does not say `judges_pairs` (the judge and rule rewards do), or `"weight"`, a negative
    weight (a verdict is the parts' weighted mean, `hpref.rl.rollout.rewards`); None when every
    part can. What online DPO and a pair-judged environment (debate) both need."""
    for part in reward_parts(config):
        if not getattr(type(part.config), "judges_pairs", False):
            return part, "pairs"
        if part.weight < 0:
            return part, "weight"
    return None
