"""`hpref rl`'s metric loggers at the `MetricsWriter` level (no Ray run): every row of
`metrics/<policy>.jsonl` reaches TensorBoard and W&B as `<policy>/<key>` (`<policy>/eval/<key>`) at
its rollout id, the leaderboard at the end, and a resume continues the TensorBoard curves with each
rollout once; plus the refusals `[logging]` / `--log` get before anything starts."""

from __future__ import annotations

import pytest

from hpref.errors import RecipeError, UserError
from tests.train.logger_files import assert_curves_match, tensorboard_scalars, wandb_curves, wandb_run

pytest.importorskip("tensorboard")


def _rows(policy: str, rollouts: range, shift: float = 0.0) -> list[dict]:
    """Rows shaped like `rollout_metrics`' and `eval_row`'s: several reward components, lengths, KL."""
    rows = []
    for r in rollouts:
        base = (ord(policy) - 96) + r / 10 + shift
        rows.append(
            {"rollout": r, "reward_mean": base, "reward_judge_mean": base / 2, "answer_tokens_p50": 10.0 + r,
             "kl": 0.01 * r, "entropy": 1.5 - r / 100, "gen_tokens": 100 + r, "weight_version": r}
        )  # fmt: skip
        if r % 2 == 1:
            evaluation = {"eval_scorer": base + 1, "eval_scorer_win_rate_vs_start": 0.5, "eval_kl": 0.02 * r}
            rows.append({"rollout": r, "eval": True, **evaluation, "eval_answer_tokens": 12.0})
    return rows


def _expected(policy_rows: dict[str, list[dict]]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for policy, rows in policy_rows.items():
        for row in rows:
            for key, value in row.items():
                if key in ("rollout", "eval"):
                    continue
                name = f"{policy}/eval/{key.removeprefix('eval_')}" if row.get("eval") else f"{policy}/{key}"
                out.setdefault(name, {})[row["rollout"]] = float(value)
    return out


def _recipe(loggers):
    from hpref.recipe.loading import recipe_from_dict

    return recipe_from_dict({"logging": {"loggers": loggers}})


def test_rl_rows_and_leaderboard_reach_tensorboard_and_wandb(tmp_path):
    """If this fails, an rl figure (reward per component, KL, entropy, lengths, eval scorer and win
    rate) is missing from a dashboard or at another rollout, policies that run at different speeds
    share one axis, or the leaderboard is not logged at the end."""
    from hpref.builtin.loggers import build_loggers
    from hpref.rl.report.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, build_loggers(_recipe(["tensorboard", "wandb"]), tmp_path, None))
    rows = {"a": _rows("a", range(4)), "b": _rows("b", range(3))}  # b runs behind a
    for r in range(4):
        for policy, policy_rows in rows.items():
            for row in policy_rows:
                if row["rollout"] == r:
                    writer.write(policy, row)
    writer.log_leaderboard({"a": 1012.5, "b": 987.5, "a@start": 1000.0}, step=4)
    writer.close()
    expected = _expected(rows)
    history, config = wandb_run(tmp_path)
    shown = {**wandb_curves(history, "a/rollout"), **wandb_curves(history, "b/rollout")}
    assert_curves_match(expected, tensorboard_scalars(tmp_path / "tensorboard"), shown)
    board = {"leaderboard/a": {4: 1012.5}, "leaderboard/b": {4: 987.5}, "leaderboard/a@start": {4: 1000.0}}
    assert_curves_match(
        board, tensorboard_scalars(tmp_path / "tensorboard"), wandb_curves(history, "leaderboard/rollout")
    )
    assert "hpref_version" in config and "logging" in config["recipe"]


def test_a_resumed_rl_run_continues_the_curves_once(tmp_path):
    """a resumes at rollout 2, b at 1 (the record's starts). If this fails, TensorBoard shows a
    rollout twice, keeps the interrupted run's values for a rollout the resumed run redid, or loses
    b's kept rows between the two starts (hidden by the purge and not logged again); or W&B shows a
    redone rollout twice, misses the resumed run's new rollouts, or restarts its own `_step` (a sync
    would then drop the resumed rows)."""
    from hpref.builtin.loggers import build_loggers
    from hpref.rl.report.metrics import MetricsWriter

    recipe = _recipe(["tensorboard", "wandb"])
    first = MetricsWriter(tmp_path, build_loggers(recipe, tmp_path, None))
    for policy in ("a", "b"):
        for row in _rows(policy, range(4)):
            first.write(policy, row)
    first.close()  # interrupted after rollout 3; the last save: a at 2, b at 1... resumed below
    starts = {"a": 2, "b": 1}
    resumed = MetricsWriter(tmp_path)
    for policy, start in starts.items():
        resumed.truncate(policy, start)
    resumed.loggers = build_loggers(recipe, tmp_path, min(starts.values()) - 1)
    for policy in starts:
        resumed.replay(policy, min(starts.values()))
    for policy, start in starts.items():  # the eval at a start was kept: it is not run again
        for row in _rows(policy, range(start, 5), shift=100.0):
            if not (row.get("eval") and row["rollout"] == start):
                resumed.write(policy, row)
    resumed.close()
    from hpref.runfolder.files import read_json_lines

    kept = {p: read_json_lines(tmp_path / "metrics" / f"{p}.jsonl") for p in starts}
    assert [r["rollout"] for r in kept["a"] if not r.get("eval")] == [0, 1, 2, 3, 4]
    expected = _expected(kept)
    assert_curves_match(expected, tensorboard_scalars(tmp_path / "tensorboard"))
    history, _config = wandb_run(tmp_path)
    assert len(history) == 2 and min(row["_step"] for row in history[1]) > max(r["_step"] for r in history[0])
    shown = {**wandb_curves(history, "a/rollout"), **wandb_curves(history, "b/rollout")}
    # W&B keeps the interrupted run's values for rollouts 2-3 (a) and 1-3 (b); rollout 4 is the resumed run's
    assert {name: sorted(points) for name, points in shown.items()} == {
        name: sorted(points) for name, points in expected.items()
    }
    assert shown["a/reward_mean"][4] == pytest.approx(expected["a/reward_mean"][4])
    assert shown["a/reward_mean"][3] == pytest.approx(1 + 0.3)  # the first run's, not the redone 101.3


def test_logging_refusals_name_the_key(tmp_path, monkeypatch):
    """If this fails, a typo in a logger's name, a missing wandb or an unwritable TensorBoard folder
    is found only once training runs (or never), or the message does not say which key is wrong."""
    from hpref.builtin.loggers import check_loggers
    from hpref.plugins import component_listing
    from hpref.recipe.logging_section import add_loggers

    with pytest.raises(
        RecipeError, match=r"logging\.loggers: unknown logger 'tensorbord' \(did you mean 'tensorboard'"
    ):
        _recipe(["tensorbord"])
    recipe = _recipe([])
    with pytest.raises(
        RecipeError, match=r"--log: logging\.loggers: unknown logger 'wand' \(did you mean 'wandb'"
    ):
        add_loggers(recipe, ["wand"], "--log")
    from hpref.recipe.loading import recipe_from_dict

    with pytest.raises(RecipeError, match=r"logging\.tensorboard\.folderr: unknown key"):
        recipe_from_dict({"logging": {"tensorboard": {"folderr": "x"}}})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    recipe = recipe_from_dict(
        {"logging": {"loggers": ["tensorboard"], "tensorboard": {"folder": str(blocker / "tb")}}}
    )
    with pytest.raises(UserError, match=r"logging\.tensorboard\.folder: .*a-file/tb is not writable"):
        check_loggers(recipe, tmp_path)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(UserError, match=r"'wandb' is selected but the wandb package is not installed"):
        check_loggers(_recipe(["wandb"]), tmp_path)
    assert {c["name"] for c in component_listing(["logger"])} == {"jsonl", "tensorboard", "wandb"}
