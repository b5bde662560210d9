"""Ratings of policies from judged battles, and the run's plot.

`bradley_terry` fits Bradley-Terry strengths to (soft) pairwise outcomes with Hunter's MM updates
and reports them on the Elo scale (400 · log10 of the strength, centred on 1000), the scale arena
leaderboards use. A weak prior (a virtual half-won battle against an average opponent) keeps the
ratings finite when one policy wins every battle.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

from hpref.runfolder.files import read_json_lines, write_bytes_atomic
from hpref.runfolder.layout import RL_METRICS

ELO_SCALE = 400.0
ELO_CENTRE = 1000.0


def bradley_terry(
    names: Sequence[str],
    battles: Sequence[tuple[str, str, float] | tuple[str, str, float, float]],
    *,
    prior: float = 0.5,
    iterations: int = 500,
    tol: float = 1e-10,
) -> dict[str, float]:
    """Elo-scale ratings from battles `(a, b, score_a)`, `score_a` in [0, 1] (1 = a won, 0.5 = tie,
    or a judge's expected score), or `(a, b, mean score_a, games)` for `games` battles at once.
    `prior` is the weight of each player's virtual battle."""
    index = {n: i for i, n in enumerate(names)}
    k = len(names)
    wins = [prior * 0.5] * k  # the virtual battle against a strength-1 opponent, half won
    games: dict[tuple[int, int], float] = {}
    for battle in battles:
        a, b, score = battle[:3]
        n = float(battle[3]) if len(battle) > 3 else 1.0  # type: ignore[misc]
        if not 0.0 <= score <= 1.0:
            raise ValueError(f"score of {a} against {b} must be in [0, 1], got {score}")
        i, j = index[a], index[b]
        wins[i] += n * score
        wins[j] += n * (1.0 - score)
        key = (min(i, j), max(i, j))
        games[key] = games.get(key, 0.0) + n
    strength = [1.0] * k
    for _ in range(iterations):
        new = []
        for i in range(k):
            denom = prior / (strength[i] + 1.0)
            for (x, y), n in games.items():
                if i in (x, y):
                    other = y if i == x else x
                    denom += n / (strength[i] + strength[other])
            new.append(wins[i] / denom if denom > 0 else strength[i])
        delta = max(abs(math.log(n) - math.log(o)) for n, o in zip(new, strength, strict=True))
        strength = new
        if delta < tol:
            break
    logs = [math.log10(s) for s in strength]
    mean = sum(logs) / k
    return {n: ELO_CENTRE + ELO_SCALE * (logs[index[n]] - mean) for n in names}


def table_battles(standings: dict[str, dict[str, list[float]]]) -> list[tuple[str, str, float, float]]:
    """The run's judged matches (`Rollout.standings`: {player: {opponent: [games, summed score]}}) as
    `bradley_terry`'s weighted battles, one per pair of players and direction."""
    return [
        (player, opponent, games[1] / games[0], games[0])
        for player, row in sorted(standings.items())
        for opponent, games in sorted(row.items())
        if games[0] > 0
    ]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values: rollouts differ by their prompts' task mix far
    more than by learning, so the raw curve hides the trend."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_metrics(run_dir: Path, policies: Sequence[str]) -> Path | None:
    """`metrics/rewards.png`: against rollout (raw, thin, and a trailing mean; one colour per policy)
    the reward, each reward component (several rewards; one line style each), the true utility
    (synthetic prompts), the policy's entropy on its answers and the answer length (median, and the
    90th percentile dashed), then each eval's win rate against the starting checkpoint."""
    folder = run_dir / RL_METRICS
    series, evals = {}, {}
    for p in policies:
        path = folder / f"{p}.jsonl"
        if path.is_file():
            rows = read_json_lines(path)
            series[p] = [r for r in rows if not r.get("eval")]
            evals[p] = [r for r in rows if r.get("eval") and "eval_win_rate_vs_start" in r]
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = [r for rows in series.values() for r in rows]

    def everywhere(key: str) -> bool:
        return bool(every) and all(key in r for r in every)

    components = sorted(
        {k[7:-5] for r in every for k in r if k.startswith("reward_") and k.endswith("_mean") and len(k) > 12}
    )
    # (title, [(metric key, line style)]): a panel only for what the run's rows carry
    panels = [("reward", [("reward_mean", "-")])]
    if components:
        styles = ["-", "--", ":", "-."]
        lines = [(f"reward_{c}_mean", styles[i % len(styles)]) for i, c in enumerate(components)]
        panels.append((f"reward components ({', '.join(components)})", lines))
    if everywhere("true_utility"):
        panels.append(("true utility (ground-truth judge)", [("true_utility", "-")]))
    if everywhere("entropy"):
        panels.append(("entropy of the policy on its answers (nats/token)", [("entropy", "-")]))
    if everywhere("answer_tokens_p50"):
        panels.append(
            ("answer tokens (median; p90 dashed)", [("answer_tokens_p50", "-"), ("answer_tokens_p90", "--")])
        )
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4))
    ax_win = axes[-1]
    for i, (p, rows) in enumerate(series.items()):
        colour = f"C{i}"
        x = [r["rollout"] for r in rows]
        window = max(1, len(rows) // 20)
        for ax, (_title, lines) in zip(axes, panels, strict=False):
            for key, style in lines:
                if not all(key in r for r in rows):
                    continue
                y = [r[key] for r in rows]
                ax.plot(x, y, color=colour, alpha=0.25, linewidth=0.8, linestyle=style)
                label = f"{p} (mean of {window})" if key == lines[0][0] else None
                ax.plot(x, moving_average(y, window), color=colour, linestyle=style, label=label)
        if evals.get(p):
            ax_win.plot(
                [r["rollout"] for r in evals[p]],
                [r["eval_win_rate_vs_start"] for r in evals[p]],
                color=colour,
                marker="o",
                label=p,
            )
    for ax, (title, _lines) in zip(axes, panels, strict=False):
        ax.set(title=title, xlabel="rollout")
    ax_win.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    ax_win.set(title="win rate vs starting checkpoint (eval, greedy)", xlabel="rollout")
    axes[0].legend()
    if any(evals.values()):
        ax_win.legend()
    fig.tight_layout()
    out = folder / "rewards.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return write_bytes_atomic(out, png.getvalue())
