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
    from hpref.rl.rollout.episodes import Played
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


def episode_figures(played: dict[str, Played]) -> dict[str, dict[str, float]]:
    """Per player, over its eval episodes: `success` (the share the environment judged a success,
    where it judges), `tool_call_share` (the share that called a tool at least once) and `turns`
    (the mean turns taken)."""
    success, calls, turns = {}, {}, {}
    for who, p in played.items():
        n = max(len(p.stats.turns), 1)
        judged = [s for s in p.stats.success if s is not None]
        if judged:
            success[who] = sum(judged) / len(judged)
        calls[who] = sum(c > 0 for c in p.stats.tool_calls) / n
        turns[who] = sum(p.stats.turns) / n
    return {"success": success, "tool_call_share": calls, "turns": turns}


async def answers_report(
    scorers: dict[str, RewardSet | None],
    truth: Callable[[tuple[str, ...], str], float] | None,
    prompts: Sequence[tuple[str, ...]],
    played: dict[str, Played],
    policies: list[str],
    rows_of: Sequence[dict[str, Any]] | None,
    episodes: bool,
) -> dict[str, Any]:
    """An eval's report from every player's greedy episodes (`played`: each policy's and its start's,
    `<id>@start`): `true_utility`, `win_rate_vs_start` and `battles` (the ground truth's, empty
    without one), `reward` / `scorer`: {"means", "win_rate_vs_start"} per scorer (`scorers`, None
    where a run has none), `answer_tokens` (mean greedy answer length per player: its own tokens),
    `leaderboard_battles`: the battles of the Bradley-Terry leaderboard (the ground truth's, else the
    eval scorer's, else the reward's, when pointwise) and `leaderboard_by`, which of them (None: none
    scored the answers pointwise), and `answers`: every answer with its scores. With `episodes`
    (an environment other than single-turn), each answer's row also holds the whole transcript (each
    message tagged with its role), its turns and tool calls, and `success` (per player, the share of
    episodes the environment judged a success, where it judges)."""
    import asyncio

    answers = {who: list(p.texts) for who, p in played.items()}
    lengths = {who: [sum(m) for m in p.masks] for who, p in played.items()}
    report: dict[str, Any] = {"true_utility": {}, "win_rate_vs_start": {}, "battles": []}
    if truth is not None:
        utilities = {
            who: [truth(q, a) for q, a in zip(prompts, said, strict=True)] for who, said in answers.items()
        }
        report = eval_report(utilities, policies)
    report["answer_tokens"] = {who: sum(n) / len(n) for who, n in lengths.items()}
    report["leaderboard_battles"] = report["battles"]
    report["leaderboard_by"] = "ground truth" if report["battles"] else None
    # every answer with its scores, for the run folder: a mean that moved says that something
    # changed, the answers say what (shorter, declining, repeating: reward hacking is read here)
    rows = {
        who: [
            {"prompt": list(q), "answer": a, "tokens": n}
            for q, a, n in zip(prompts, said, lengths[who], strict=True)
        ]
        for who, said in answers.items()
    }
    if episodes:
        report.update(episode_figures(played))
        for who, p in played.items():
            for i, row in enumerate(rows[who]):
                row["transcript"] = [{"role": role, "text": text} for role, text in p.transcripts[i]]
                row.update(turns=p.stats.turns[i], tool_calls=p.stats.tool_calls[i])
                row.update(truncated=p.stats.truncated[i], success=p.stats.success[i])
    for name, reward in scorers.items():
        if reward is None:
            continue
        # a judge model's forward pass would block the event loop that serves every policy's get()
        scored = await asyncio.to_thread(scorer_report, reward, prompts, answers, policies, rows_of)
        report[name] = {"means": scored["means"], "win_rate_vs_start": scored["win_rate_vs_start"]}
        if scored["components"]:
            report["reward_components"] = scored["components"]
        for who, scores in scored["scores"].items():
            for row, score in zip(rows[who], scores, strict=True):
                row[name] = score
        if not report["leaderboard_battles"] and scored["battles"]:
            report["leaderboard_battles"] = scored["battles"]
            report["leaderboard_by"] = "eval scorer" if name == "scorer" else "reward"
    report["answers"] = rows
    return report
