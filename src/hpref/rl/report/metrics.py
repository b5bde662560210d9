"""The metrics of an `hpref rl` run: one row per policy and rollout (and per eval), one JSON line each.

`<run_dir>/metrics/<policy>.jsonl` is appended as the run goes; a resume first drops the rows written
after the save it starts from (`MetricsWriter.truncate`, `keep_row`), so nothing is counted twice.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpref.runfolder.files import append_json_line, read_json_lines, write_text_atomic
from hpref.runfolder.layout import RL_EVAL_ANSWERS, RL_METRICS

if TYPE_CHECKING:
    from hpref.rl.rollout_types import Rollout


class MetricsWriter:
    """`<run_dir>/metrics/<policy>.jsonl`, one JSON object per line, appended (resumes continue it)."""

    def __init__(self, run_dir: Path | None, loggers: Any = None) -> None:
        self.folder = None if run_dir is None else run_dir / RL_METRICS
        self.rows: dict[str, list[dict[str, Any]]] = {}
        #: the run's metric loggers (`hpref.builtin.loggers.MetricLoggers`; the leader's process only)
        self.loggers = loggers

    def truncate(self, policy: str, start: int) -> int:
        """Drop rows of rollouts at or after `start` (written after the save a resume starts from,
        so they would be counted twice); returns how many were dropped."""
        if self.folder is None or not (self.folder / f"{policy}.jsonl").is_file():
            return 0
        path = self.folder / f"{policy}.jsonl"
        rows = read_json_lines(path)  # a last line cut by a crash mid-append is dropped
        kept = [row for row in rows if keep_row(row, start)]
        write_text_atomic(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in kept))
        return len(rows) - len(kept)

    def write(self, policy: str, row: dict[str, Any]) -> None:
        self.rows.setdefault(policy, []).append(row)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            append_json_line(self.folder / f"{policy}.jsonl", row, sort_keys=True)  # a log: appended
        if self.loggers:
            self.loggers.rl_row(policy, row)

    def replay(self, policy: str, start: int) -> None:
        """After a resume's `truncate`: hand the loggers the kept rows from `start` on. TensorBoard
        hides every step from the run's first resumed rollout (`purge_step`: the smallest policy
        start), so a policy that resumes further on gets its kept rows past that point again."""
        if not self.loggers or self.folder is None or not (self.folder / f"{policy}.jsonl").is_file():
            return
        for row in read_json_lines(self.folder / f"{policy}.jsonl"):
            if row["rollout"] >= start:
                self.loggers.rl_row(policy, row)

    def log_leaderboard(self, leaderboard: dict[str, float], step: int) -> None:
        """The end-of-run leaderboard (Bradley-Terry ratings) as `leaderboard/<player>` at `step`."""
        if not self.loggers:
            return
        values = {f"leaderboard/{player}": float(rating) for player, rating in leaderboard.items()}
        self.loggers.emit(values, step, "leaderboard/rollout")

    def close(self) -> None:
        if self.loggers:
            self.loggers.close()

    def write_answers(self, name: str, answers: dict[str, list[dict[str, Any]]]) -> Path | None:
        """An eval's greedy answers, one JSON row per (player, prompt) with its scores, to
        `<run_dir>/metrics/eval_answers/<name>.jsonl` (`start`, or `rollout-000040`); rewritten
        whole, so a resumed run's repeated eval replaces the first one's file."""
        if self.folder is None or not answers:
            return None
        from hpref.runfolder.files import write_bytes_atomic

        lines = [
            json.dumps({"player": who, **row}, sort_keys=True, ensure_ascii=False)
            for who, rows in answers.items()
            for row in rows
        ]
        path = self.folder / RL_EVAL_ANSWERS / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, "".join(line + "\n" for line in lines).encode("utf-8"))
        return path


def last_rollout_rows(run_dir: Path, policies: list[str]) -> dict[str, dict[str, Any]]:
    """Each policy's last training row of metrics.jsonl (its reward and reward components, entropy,
    clip fraction, answer lengths at the end of the run), for `rl_summary.json`."""
    out = {}
    for policy in policies:
        path = run_dir / RL_METRICS / f"{policy}.jsonl"
        rows = [r for r in read_json_lines(path) if not r.get("eval")] if path.is_file() else []
        if rows:
            out[policy] = rows[-1]
    return out


def keep_row(row: dict[str, Any], start: int) -> bool:
    """Whether a metrics row survives a resume at `start`: training rows of earlier rollouts, and
    eval rows taken at or before the resumed position."""
    return row["rollout"] <= start if row.get("eval") else row["rollout"] < start


def rollout_metrics(rollout: Rollout, stats: dict[str, float], version: int | None) -> dict[str, Any]:
    """The metrics row of one policy's rollout: reward and true utility, throughput, versions, and
    for a pairwise algorithm the share of its judged pairs that were ties."""
    rewards = rollout.rewards
    mean = sum(rewards) / len(rewards)
    row: dict[str, Any] = {
        "rollout": rollout.rollout_id,
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "data_version": rollout.version,
        "weight_version": version,
        "gen_tokens": rollout.tokens,
        "answer_tokens": rollout.tokens / max(len(rewards), 1),  # one reward per answer
        "gen_tokens_per_s": rollout.tokens / max(rollout.seconds, 1e-9),
        "opponent_tokens": rollout.opponent_tokens,
        "stale_regenerated": rollout.stale_regenerated,
    }
    row.update(length_percentiles(rollout.own_lengths()))
    if rollout.episodes is not None:
        row.update(episode_metrics(rollout))
    for name, values in (rollout.reward_components or {}).items():  # several rewards: each on its own
        row[f"reward_{name}_mean"] = sum(values) / len(values)
    if rollout.true_utility:
        row["true_utility"] = sum(rollout.true_utility) / len(rollout.true_utility)
    if rollout.verdicts:
        row["judged_pairs"] = len(rollout.pairs)
        # pairs against another policy's answer (online DPO's cross-policy pairs)
        row["cross_policy_pairs"] = sum(second >= len(rollout.completions) for _, second in rollout.pairs)
        row["judged_tie_share"] = sum(v[2] for v in rollout.verdicts) / len(rollout.verdicts)
    if rollout.matches:  # against other policies: the live leaderboard's input, as a win rate
        row["matches"] = len(rollout.matches)
        row["match_score_mean"] = sum(m[2] for m in rollout.matches) / len(rollout.matches)
    row.update(stats)
    return row


def episode_metrics(rollout: Rollout) -> dict[str, float]:
    """An environment's rollout (`[rl.environment]` other than single-turn): turns, tool calls and tool
    errors per episode, the share of episodes a bound cut short (`truncated_share`), and the share the
    environment judged a success (where it judges any)."""
    stats = rollout.episodes
    assert stats is not None
    n = max(len(stats.turns), 1)
    row = {
        "turns_mean": sum(stats.turns) / n,
        "tool_calls_mean": sum(stats.tool_calls) / n,
        "tool_errors_mean": sum(stats.tool_errors) / n,
        "truncated_share": sum(stats.truncated) / n,
    }
    judged = [s for s in stats.success if s is not None]
    if judged:
        row["success"] = sum(judged) / len(judged)
    if any(stats.turn_rewards):
        row["turn_reward_mean"] = sum(stats.turn_rewards) / n
    return row


def length_percentiles(lengths: list[int]) -> dict[str, float]:
    """`answer_tokens_p10`, `_p50`, `_p90` and `_max` of a rollout's answer lengths (eos included):
    a mean hides the answers that collapse to nothing or run to the token limit."""
    if not lengths:
        return {}
    ordered = sorted(lengths)
    if len(ordered) == 1:
        deciles = [float(ordered[0])] * 9
    else:  # linear interpolation between the closest ranks (numpy's default percentile)
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
    return {
        "answer_tokens_p10": deciles[0],
        "answer_tokens_p50": deciles[4],
        "answer_tokens_p90": deciles[8],
        "answer_tokens_max": float(ordered[-1]),
    }


#: an eval's scorers, as its report names them (`RolloutExecutor.evaluate`) and its rows prefix them
EVAL_SCORERS = ("reward", "scorer")


def eval_row(evaluation: dict[str, Any], policy: str) -> dict[str, Any]:
    """The metrics row of one policy at an eval: per scorer its mean on the held-out prompts, its
    start's, and its win rate against the start; answer lengths; KL to the start; the ground truth
    when the prompts have one."""
    row: dict[str, Any] = {"eval": True}
    start = f"{policy}@start"
    truth = evaluation.get("true_utility", {})
    if policy in truth:
        row["eval_true_utility"] = truth[policy]
        if start in truth:
            row["eval_start_true_utility"] = truth[start]
        if policy in evaluation.get("win_rate_vs_start", {}):
            row["eval_win_rate_vs_start"] = evaluation["win_rate_vs_start"][policy]
    for name in EVAL_SCORERS:
        scored = evaluation.get(name)
        if not scored or policy not in scored["means"]:
            continue
        row[f"eval_{name}"] = scored["means"][policy]
        if start in scored["means"]:
            row[f"eval_{name}_start"] = scored["means"][start]
        if policy in scored["win_rate_vs_start"]:
            row[f"eval_{name}_win_rate_vs_start"] = scored["win_rate_vs_start"][policy]
    for name, means in evaluation.get("reward_components", {}).items():  # several rewards: each alone
        if policy in means:
            row[f"eval_reward_{name}"] = means[policy]
            if start in means:
                row[f"eval_reward_{name}_start"] = means[start]
    lengths = evaluation.get("answer_tokens", {})
    if policy in lengths:
        row["eval_answer_tokens"] = lengths[policy]
        if start in lengths:
            row["eval_answer_tokens_start"] = lengths[start]
    if policy in evaluation.get("kl", {}):
        row["eval_kl"] = evaluation["kl"][policy]
    for name in ("success", "tool_call_share", "turns"):  # an environment's episodes (#49)
        figures = evaluation.get(name, {})
        if policy in figures:
            row[f"eval_{name}"] = figures[policy]
            if start in figures:
                row[f"eval_{name}_start"] = figures[start]
    return row


def eval_line(evaluation: dict[str, Any], policy: str) -> str:
    """One policy's eval in a few words, for the log: `a reward 0.41 (start 0.12), scorer ...`."""
    row = eval_row(evaluation, policy)
    parts = []
    for key, label in (("eval_true_utility", "true utility"), *((f"eval_{n}", n) for n in EVAL_SCORERS)):
        if key in row:
            start = row.get(
                f"{key}_start", row.get("eval_start_true_utility") if key == "eval_true_utility" else None
            )
            parts.append(f"{label} {row[key]:.3f}" + (f" (start {start:.3f})" if start is not None else ""))
    components = [
        k[12:] for k in row if k.startswith("eval_reward_") and not k.endswith(("_start", "_vs_start"))
    ]
    if components:  # several rewards: each one's mean
        parts.append("(" + ", ".join(f"{c} {row[f'eval_reward_{c}']:.3f}" for c in components) + ")")
    win = row.get("eval_scorer_win_rate_vs_start", row.get("eval_win_rate_vs_start"))
    if win is not None:
        parts.append(f"win rate vs start {win:.3f}")
    if "eval_answer_tokens" in row:
        parts.append(f"{row['eval_answer_tokens']:.1f} tokens")
    if "eval_kl" in row:
        parts.append(f"KL {row['eval_kl']:.4f}")
    if "eval_success" in row:
        start = row.get("eval_success_start")
        parts.append(
            f"success {row['eval_success']:.3f}" + (f" (start {start:.3f})" if start is not None else "")
        )
    # an environment without tools (debate, signal) has every share 0: said only where a call was made
    if row.get("eval_tool_call_share") or row.get("eval_tool_call_share_start"):
        parts.append(f"tool calls in {row['eval_tool_call_share']:.0%} of episodes")
    return f"{policy} " + ", ".join(parts)
