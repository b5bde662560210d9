"""Pairing, a rollout service an algorithm asks for (`Algorithm.needs_preferences`): a rollout's answers
paired and judged three ways by the run's reward (`PairJudge.judge_answers`), each answer's reward
its mean verdict. Online DPO trains on these pairs; GRPO with a judge reward scores the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from hpref.rl.rollout_types import Verdict

if TYPE_CHECKING:
    from hpref.data.prompts import Prompt
    from hpref.rl.protocols import PairJudge


class JudgedPairs(NamedTuple):
    """A rollout's judged pairs, typed: the `Rollout` fields an algorithm that `needs_preferences`
    trains on (`pairs`, `verdicts`, `opponent_texts`), and a reward per answer."""

    pairs: list[tuple[int, int]]
    verdicts: list[Verdict]
    opponent_texts: list[str]
    rewards: list[float]
    #: the policy each opponent text came from (`owners`), in `opponent_texts`' order
    opponent_policies: list[str] = []

    def matches(self, policy: str, own: int) -> list[tuple[str, str, float]]:
        """The cross-policy pairs as the live leaderboard's matches: (policy, the opponent's policy,
        the policy's P(preferred) + P(tie)/2), one per pair against another policy's answer."""
        return [
            (policy, self.opponent_policies[second - own], v[0] + 0.5 * v[2])
            for (_, second), v in zip(self.pairs, self.verdicts, strict=True)
            if second >= own and self.opponent_policies
        ]

    @classmethod
    def none(cls) -> JudgedPairs:
        """What a rollout of an algorithm that asks for no preferences carries: no pairs."""
        return cls([], [], [], [])


def judged_pairs(
    judge: PairJudge,
    prompts: Sequence[Prompt],
    groups: Sequence[Sequence[str]],
    opponents: Sequence[Sequence[str]] | None = None,
    rows: Sequence[dict[str, Any]] | None = None,
    owners: Sequence[Sequence[str]] | None = None,
) -> JudgedPairs:
    """Pair a rollout's answers and judge them: (pairs as rows, verdicts, opponent texts, a reward per
    answer). Without `opponents` a group's answers pair two by two (rows 2k, 2k + 1); with them each
    answer pairs with one opponent answer to its prompt, taken in turn. An answer's reward is its
    mean P(preferred) + half P(tie) over its pairs: the pairwise reward GRPO's judge gives. `rows[i]`:
    the prompt file's row of `prompts[i]`, for a judge that reads it (`hpref.rl.rollout.rewards`);
    `owners[i][j]`: the policy whose answer `opponents[i][j]` is."""
    pairs: list[tuple[int, int]] = []
    texts: list[tuple[str, str]] = []
    pair_prompts: list[Prompt] = []
    pair_rows: list[dict[str, Any]] = []
    opponent_texts: list[str] = []
    opponent_policies: list[str] = []
    own = sum(len(g) for g in groups)
    row = 0
    for g, (prompt, answers) in enumerate(zip(prompts, groups, strict=True)):
        rivals = list(opponents[g]) if opponents else []
        for k, answer in enumerate(answers):
            if rivals:
                opponent_texts.append(rivals[k % len(rivals)])
                if owners:
                    opponent_policies.append(owners[g][k % len(rivals)])
                pairs.append((row + k, own + len(opponent_texts) - 1))
                texts.append((answer, opponent_texts[-1]))
                pair_prompts.append(prompt)
                pair_rows.append(rows[g] if rows else {})
            elif k % 2 == 0:
                pairs.append((row + k, row + k + 1))
                texts.append((answer, answers[k + 1]))
                pair_prompts.append(prompt)
                pair_rows.append(rows[g] if rows else {})
        row += len(answers)
    extra = {"rows": pair_rows} if rows is not None else {}
    verdicts = [tuple(float(p) for p in v) for v in judge.judge_answers(pair_prompts, texts, **extra)]
    scores: list[list[float]] = [[] for _ in range(own)]
    for (first, second), (p_first, p_second, p_tie) in zip(pairs, verdicts, strict=True):
        scores[first].append(p_first + 0.5 * p_tie)
        if second < own:
            scores[second].append(p_second + 0.5 * p_tie)
    rewards = [sum(s) / len(s) for s in scores]
    return JudgedPairs(pairs, verdicts, opponent_texts, rewards, opponent_policies)  # type: ignore[arg-type]
