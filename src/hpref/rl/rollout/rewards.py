"""The rewards of an `hpref rl` run as one reward: `[rl.reward]` alone, or several `[rl.rewards.<name>]`
components whose weighted sum the policies train on (TRL's `reward_funcs` with `reward_weights`).

    rewards = RewardSet.from_parts(reward_parts(config))     # hpref.recipe.rl_rewards
    total, parts = rewards.score_components(prompts, groups, opponents, rows)
    # total[i][k] = sum_c weight_c * parts[c][i][k]

The rollout executor talks to nothing else: every component keeps its own protocol
(`hpref.rl.protocols.Reward`) and gets only what it asks for — other policies' answers when it
`wants_opponents`, the prompt file's rows when it `wants_rows` (a `rule` function of
`(prompt, answer, row)`). Components are scored at the same time on threads (a judge's forward pass
and a remote reward's HTTP wait release the GIL), so several rewards cost about the slowest one.

With several components, other policies' answers are collected once for the component that wants
the most (`opponent_answers`), and each pairwise component is judged against all of them. A pair
verdict (online DPO, `judge_answers`) is the weighted mean of the components' verdicts, which needs
every component to judge pairs and no negative weight (`hpref.rl.algorithms.registry` checks both).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpref.recipe.rl_rewards import RewardPart
    from hpref.rl.protocols import Prompt, Reward
    from hpref.rl.rollout_types import Verdict


def build_reward(name: str, config: Any) -> Reward:
    """A registered reward component (`[rl.reward]`, one of `[rl.rewards]` or `[rl.eval_scorer]`) from
    its validated config."""
    from hpref.plugins import load_plugins

    return load_plugins().get("reward", name).build(config)


@dataclass
class Component:
    name: str
    reward: Any
    weight: float


class RewardSet:
    """Weighted reward components as one `hpref.rl.protocols.Reward` (see the module docstring)."""

    def __init__(self, components: list[Component], named: bool) -> None:
        if not components:
            raise ValueError("a reward set needs at least one component")
        self.components = components
        #: the components were named in the recipe (`[rl.rewards.<name>]`): each is logged on its own
        self.named = named
        rewards = [c.reward for c in components]
        self.wants_opponents = any(getattr(r, "wants_opponents", False) for r in rewards)
        self.opponent_answers = max(
            (int(getattr(r, "opponent_answers", 1)) for r in rewards if getattr(r, "wants_opponents", False)),
            default=1,
        )
        self.pairwise = any(getattr(r, "pairwise", False) for r in rewards)
        self.wants_rows = any(getattr(r, "wants_rows", False) for r in rewards)
        truths = [r for r in rewards if hasattr(r, "true_utility")]
        #: the ground truth (the synthetic arena's), when a component knows it
        self.true_utility = truths[0].true_utility if truths else None
        self.judges_pairs = all(hasattr(r, "judge_answers") for r in rewards)

    @classmethod
    def from_parts(cls, parts: list[RewardPart]) -> RewardSet:
        """Build each part's component (`hpref.recipe.rl_rewards.reward_parts`)."""
        named = not (len(parts) == 1 and parts[0].key == "rl.reward")
        return cls(
            [Component(p.name, build_reward(p.section.name, p.config), p.weight) for p in parts], named
        )

    @classmethod
    def single(cls, reward: Any, name: str = "reward") -> RewardSet:
        """One reward (the eval scorer) behind the same calls."""
        return cls([Component(name, reward, 1.0)], named=False)

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    def _score(
        self,
        component: Component,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None,
        rows: Sequence[dict[str, Any]] | None,
    ) -> list[list[float]]:
        reward = component.reward
        extra: dict[str, Any] = {}
        if getattr(reward, "wants_rows", False):
            extra["rows"] = rows
        theirs = opponents if getattr(reward, "wants_opponents", False) else None
        scored = reward.score_groups(prompts, groups, theirs, **extra)
        return [[float(s) for s in group] for group in scored]

    def score_components(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[list[list[float]], dict[str, list[list[float]]]]:
        """(the weighted sum per answer, each component's scores per answer), shaped like `groups`."""
        if len(self.components) == 1:
            scores = [self._score(self.components[0], prompts, groups, opponents, rows)]
        else:
            with ThreadPoolExecutor(max_workers=len(self.components), thread_name_prefix="reward") as pool:
                jobs = [
                    pool.submit(self._score, c, prompts, groups, opponents, rows) for c in self.components
                ]
                scores = [job.result() for job in jobs]
        parts = {c.name: s for c, s in zip(self.components, scores, strict=True)}
        if len(self.components) == 1 and self.components[0].weight == 1.0:
            return scores[0], parts
        total = [
            [sum(c.weight * parts[c.name][g][k] for c in self.components) for k in range(len(group))]
            for g, group in enumerate(groups)
        ]
        return total, parts

    def score_groups(
        self,
        prompts: Sequence[Prompt],
        groups: Sequence[Sequence[str]],
        opponents: Sequence[Sequence[str]] | None = None,
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> list[list[float]]:
        """The weighted sum of the components' rewards (`hpref.rl.protocols.Reward.score_groups`)."""
        return self.score_components(prompts, groups, opponents, rows)[0]

    def judge_answers(
        self,
        prompts: Sequence[Prompt],
        pairs: Sequence[tuple[str, str]],
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> list[Verdict]:
        """Each pair's verdict: the components' verdicts averaged with their weights (normalised; a
        weight-0 component has no say), so it stays a distribution over (first, second, tie)."""
        voting = [c for c in self.components if c.weight > 0]
        total = sum(c.weight for c in voting)
        out = [[0.0, 0.0, 0.0] for _ in pairs]
        for c in voting:
            extra = {"rows": rows} if getattr(c.reward, "wants_rows", False) else {}
            for verdict, probs in zip(out, c.reward.judge_answers(prompts, pairs, **extra), strict=True):
                for j in range(3):
                    verdict[j] += c.weight / total * float(probs[j])
        return [tuple(v) for v in out]  # type: ignore[misc]
