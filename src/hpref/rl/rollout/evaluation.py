"""The numbers of an `hpref rl` eval: mean scores, win rates against the start, and the battles of
the Bradley-Terry leaderboard.

An eval answers fixed held-out prompts greedily with every policy and with its starting checkpoint
(`<id>@start`). Each answer is then scored by up to three scorers:

- `true_utility`: the ground truth, when the prompts have one (the synthetic arena); two answers'
  utilities give the arena judge's outcome probabilities (Davidson's model, `hpref.arena.davidson`);
- `reward`: the reward the policies train on;
- `scorer`: `[rl.eval_scorer]`, a second reward the policies never trained against. A reward that
  went up under `reward` but not under `scorer` is the sign of reward hacking.

A pointwise scorer (a reward model: one score per answer) reads two scores as a Bradley-Terry
preference, P(p beats q) = sigmoid(s_p - s_q); a pairwise scorer (a judge) compares the two answers
itself. Either way the expected score of one answer against another is P(win) + P(tie) / 2, and a
win rate against the start of 0.5 means no better than where the policy began. These functions do
the numbers; the rollout executor only gathers the answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpref.rl.rollout.rewards import RewardSet

Utilities = dict[str, list[float]]  # player (a policy, or `<id>@start`) -> score per eval prompt
Expected = Callable[[float, float], float]  # two answers' scores -> expected score of the first


def davidson_expected(a: float, b: float) -> float:
    """P(win) + P(tie) / 2 of an answer of utility `a` against one of utility `b` (the arena judge)."""
    from hpref.arena import davidson

    win, _lose, tie = davidson(a, b)
    return win + 0.5 * tie


def bradley_terry_expected(a: float, b: float) -> float:
    """P(an answer scored `a` beats one scored `b`) under a Bradley-Terry reward model."""
    return 1.0 / (1.0 + math.exp(-(a - b))) if a - b > -700 else 0.0


def expected_scores(
    u_p: list[float], u_q: list[float], expected: Expected = davidson_expected
) -> list[float]:
    """Per prompt, the expected score of p's answer against q's."""
    return [expected(a, b) for a, b in zip(u_p, u_q, strict=True)]


def eval_report(
    utilities: Utilities, policies: list[str], expected: Expected = davidson_expected
) -> dict[str, Any]:
    """`true_utility` (mean per player), `win_rate_vs_start` (per policy that has a start: its mean
    expected score against its starting checkpoint) and `battles`: one `(p, q, expected score of p)`
    per prompt and pair of players. `expected` reads two scores (ground truth by default)."""
    players = list(utilities)
    battles = []
    for i, p in enumerate(players):
        for q in players[i + 1 :]:
            battles.extend((p, q, score) for score in expected_scores(utilities[p], utilities[q], expected))
    win_rates = {}
    for p in policies:
        if p in utilities and f"{p}@start" in utilities:
            scores = expected_scores(utilities[p], utilities[f"{p}@start"], expected)
            win_rates[p] = sum(scores) / len(scores)
    return {
        "true_utility": {p: sum(u) / len(u) for p, u in utilities.items()},
        "win_rate_vs_start": win_rates,
        "battles": battles,
    }


def scorer_report(
    reward: RewardSet,
    prompts: Sequence[tuple[str, ...]],
    answers: dict[str, list[str]],
    policies: list[str],
    rows: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One scorer's view of an eval's answers (the training rewards, `hpref.rl.rollout.rewards`, or the
    eval scorer): `scores` (per player, one per prompt), `means` per player, `win_rate_vs_start` per
    policy, `battles` for the leaderboard (pointwise scorers only; a judge's group scores are
    relative to the group, not scores of single answers), and with named rewards `components`: each
    component's mean per player.

    `answers[player][i]` answers `prompts[i]` (`rows[i]`: its prompt file row, for rewards that read
    it). A pointwise reward scores every answer once; a pairwise one (`reward.pairwise`) is asked
    each prompt's answers of all players as one group (an answer's score: its mean expected score
    against the others) and each policy's answer against its start's.
    """
    players = list(answers)
    groups = [[answers[p][i] for p in players] for i in range(len(prompts))]
    scored, parts = reward.score_components(list(prompts), groups, None, rows)

    def by_player(table: list[list[float]]) -> dict[str, list[float]]:
        return {p: [float(table[i][k]) for i in range(len(prompts))] for k, p in enumerate(players)}

    per_player = by_player(scored)
    means = {p: sum(s) / len(s) for p, s in per_player.items()}
    components = {}
    if reward.named:
        for name, table in parts.items():
            components[name] = {p: sum(s) / len(s) for p, s in by_player(table).items()}
    starts = [p for p in policies if p in answers and f"{p}@start" in answers]
    if not reward.pairwise:
        report = eval_report(per_player, policies, bradley_terry_expected)
        return {
            "scores": per_player,
            "means": means,
            "components": components,
            "win_rate_vs_start": report["win_rate_vs_start"],
            "battles": report["battles"],
        }
    win_rates = {}
    for p in starts:
        pairs = reward.score_groups(
            list(prompts),
            [[a, b] for a, b in zip(answers[p], answers[f"{p}@start"], strict=True)],
            None,
            rows,
        )
        win_rates[p] = sum(float(g[0]) for g in pairs) / len(pairs)
    return {
        "scores": per_player,
        "means": means,
        "components": components,
        "win_rate_vs_start": win_rates,
        "battles": [],
    }
