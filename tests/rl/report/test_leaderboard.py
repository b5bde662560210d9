"""Bradley-Terry ratings on the Elo scale, against closed forms."""

from __future__ import annotations

import json
import math

import pytest

from hpref.rl.report.leaderboard import bradley_terry, plot_metrics


def test_two_players_rating_gap_is_the_log_odds():
    # a wins 3 of 4: strength ratio 3 -> 400 log10(3) = 190.8 Elo apart (no prior)
    battles = [("a", "b", 1.0)] * 3 + [("a", "b", 0.0)]
    r = bradley_terry(["a", "b"], battles, prior=0.0)
    assert r["a"] - r["b"] == pytest.approx(400 * math.log10(3), abs=1e-3)
    assert (r["a"] + r["b"]) / 2 == pytest.approx(1000.0)


def test_ties_and_soft_scores_count_half():
    soft = bradley_terry(["a", "b"], [("a", "b", 0.75)] * 4, prior=0.0)
    hard = bradley_terry(["a", "b"], [("a", "b", 1.0)] * 3 + [("b", "a", 1.0)], prior=0.0)
    assert soft["a"] - soft["b"] == pytest.approx(hard["a"] - hard["b"], abs=1e-3)
    even = bradley_terry(["a", "b"], [("a", "b", 0.5)] * 5)
    assert even["a"] == pytest.approx(even["b"])


def test_prior_keeps_a_clean_sweep_finite_and_order_is_transitive():
    r = bradley_terry(["a", "b", "c"], [("a", "b", 1.0)] * 5 + [("b", "c", 1.0)] * 5)
    assert all(math.isfinite(v) for v in r.values())
    assert r["a"] > r["b"] > r["c"]
    with pytest.raises(ValueError, match="must be in"):
        bradley_terry(["a", "b"], [("a", "b", 1.5)])


def test_plot_is_written_from_the_metrics_files(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    rows = [{"rollout": i, "reward_mean": i * 0.1, "true_utility": 1.0} for i in range(3)]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_metrics(tmp_path, ["a", "missing"])
    assert out is not None and out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    assert plot_metrics(tmp_path / "empty", ["a"]) is None


def test_moving_average_is_trailing_and_starts_from_what_there_is():
    # Wrong if the smoothed curve looked ahead (a trend would show before it happened) or the first
    # points were averaged with zeros.
    from hpref.rl.report.leaderboard import moving_average

    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 5) == [2.0, 3.0]
    assert moving_average([1.0, 2.0], 1) == [1.0, 2.0]


def test_plot_includes_eval_win_rates(tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    rows = [{"rollout": i, "reward_mean": 0.1 * i, "true_utility": 0.2 * i} for i in range(40)]
    rows += [{"eval": True, "rollout": 20, "eval_true_utility": 1.0, "eval_win_rate_vs_start": 0.6}]
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_metrics(tmp_path, ["a"])
    assert out is not None and out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 1000
