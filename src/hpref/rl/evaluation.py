"""The numbers of an `hpref rl` eval: win rates and the battles of the Bradley-Terry leaderboard.

An eval answers fixed prompts greedily with every policy and with its starting checkpoint
(`<id>@start`), and the reward's ground truth gives each answer a utility. Two answers' utilities
give the arena judge's outcome probabilities (Davidson's model, `hpref.arena.davidson`), so the
expected score of one answer against another is P(win) + P(tie) / 2. These pure functions turn the
utilities into the eval's report; the rollout executor only gathers the answers.
"""

from __future__ import annotations

from typing import Any

Utilities = dict[str, list[float]]  # player (a policy, or `<id>@start`) -> utility per eval prompt


def expected_scores(u_p: list[float], u_q: list[float]) -> list[float]:
    """Per prompt, the expected score of p's answer against q's: P(win) + P(tie) / 2."""
    from hpref.arena import davidson

    out = []
    for a, b in zip(u_p, u_q, strict=True):
        win, _lose, tie = davidson(a, b)
        out.append(win + 0.5 * tie)
    return out


def eval_report(utilities: Utilities, policies: list[str]) -> dict[str, Any]:
    """`true_utility` (mean per player), `win_rate_vs_start` (per policy that has a start: its mean
    expected score against its starting checkpoint; 0.5 = no better than where it began) and
    `battles`: one `(p, q, expected score of p)` per prompt and pair of players."""
    players = list(utilities)
    battles = []
    for i, p in enumerate(players):
        for q in players[i + 1 :]:
            battles.extend((p, q, score) for score in expected_scores(utilities[p], utilities[q]))
    win_rates = {}
    for p in policies:
        if f"{p}@start" in utilities:
            scores = expected_scores(utilities[p], utilities[f"{p}@start"])
            win_rates[p] = sum(scores) / len(scores)
    return {
        "true_utility": {p: sum(u) / len(u) for p, u in utilities.items()},
        "win_rate_vs_start": win_rates,
        "battles": battles,
    }
