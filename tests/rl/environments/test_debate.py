"""`debate` (#50): two policies answer a prompt unseen, read each other's answer and revise, and the
run's pair judge scores the final pair, both orders averaged; the matches it judges feed the live
Bradley-Terry table (counted once per taken rollout, kept by a save). Scripted engines and judges in
milliseconds; one in-process drive of two tiny policies on the arena's rule judge (a few seconds)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from hpref.errors import RecipeError  # noqa: E402
from hpref.models.causal_lm import observation_ids, policy_tokenizer  # noqa: E402
from hpref.plugins import load_plugins  # noqa: E402
from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.control.preflight import check_cast  # noqa: E402
from hpref.rl.environments.debate import DebateConfig  # noqa: E402
from hpref.rl.report.leaderboard import bradley_terry, table_battles  # noqa: E402
from hpref.rl.rollout.joint import play_together  # noqa: E402
from tests.rl.environments.test_together import scripted_engines, seating  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

YES, NO = "yes it is", "no"


def debate(**params):
    return load_plugins().get("environment", "debate").build(DebateConfig(**params))


def config(roles=None, policies=("a", "b"), reward="rule", **rl):
    return parse_rl_section(
        {
            "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6},
            "reward": {"name": reward},
            "environment": {"name": "debate", "roles": roles or {"first": "a", "second": "b"}},
            "defaults": {"model": TINY},
            "policies": {p: {} for p in policies},
            **rl,
        },
        "r.toml",
    )


@pytest.fixture(scope="module")
def tokenizer():
    return policy_tokenizer(config().policies["a"].model)


def prefers_yes(calls):
    """A judge that prefers an answer saying "yes" and also favours the first position: (first,
    second, tie) of each pair; every call recorded."""

    async def judge(prompts, pairs, rows):
        calls.append(list(pairs))
        out = []
        for x, y in pairs:
            if ("yes" in x) == ("yes" in y):
                out.append((0.5, 0.2, 0.3))  # position bias alone
            else:
                out.append((0.8, 0.1, 0.1) if "yes" in x else (0.2, 0.7, 0.1))
        return out

    return judge


def test_both_answer_unseen_then_each_revises_on_the_others_first_answer(tokenizer):
    """Two rounds, `first` = a, `second` = b, 8 episodes: each role's first answer is written with no
    observation before it (unseen), then each revises reading the other's round-1 answer (never the
    other's revision); the seed draws which role opens each episode, so every round asks both
    engines (4 rounds, two calls each); the judge reads the last answers in both orders in one call.
    Wrong: a role answering after reading the other (an unfair debate), a reader shown the wrong
    answer, an engine idle while the other works, or one order judged (position bias in the reward)."""

    def said(policy, call, j):  # "<policy> one" before reading the other, "<policy> two" after
        return f"{policy} {'two' if 'Another assistant' in tokenizer.decode(calls[-1][1][j]) else 'one'}"

    sample, calls = scripted_engines(tokenizer, said)
    judged = []
    seats = seating(tokenizer, {"first": "a", "second": "b"})
    prompts, rows = [("q0",), ("q1",)], [{}, {}]
    played = asyncio.run(play_together(debate(), seats, sample, prompts, rows, 4, 3, prefers_yes(judged)))
    rounds = sorted({seed for _, _, seed in calls})
    assert len(rounds) == 4 and [sorted(c[0] for c in calls if c[2] == r) for r in rounds] == [["a", "b"]] * 4
    a, b = played["a"], played["b"]
    revise = DebateConfig().revise_prompt.format
    assert a.transcripts == [[("first", "a one"), ("user", revise(other="b one")), ("first", "a two")]] * 8
    assert b.transcripts == [[("second", "b one"), ("user", revise(other="a one")), ("second", "b two")]] * 8
    eos = tokenizer.eos_token_id
    one, two = (tokenizer.encode(t, add_special_tokens=False) + [eos] for t in ("a one", "a two"))
    read = observation_ids(tokenizer, "user", revise(other="b one"))
    assert a.completions[0] == one + read + two  # a's row: its answer, b's first answer read, its revision
    assert a.masks[0] == [1] * len(one) + [0] * len(read) + [1] * len(two)
    assert a.texts == ["a two"] * 8 and b.texts == ["b two"] * 8  # the final answers are judged
    assert judged == [[("a two", "b two"), ("b two", "a two")] * 8]
    # position bias alone (neither says yes): both orders averaged, a draw at 0.5 each
    assert [r["first"] for r in a.rewards] == [pytest.approx(0.5)] * 8
    assert [r["second"] for r in b.rewards] == [pytest.approx(0.5)] * 8
    assert a.matches == [("a", "b", pytest.approx(0.5))] * 8 and b.matches == []
    assert a.stats.turns == [2] * 8 and b.stats.turns == [2] * 8


def test_the_verdict_is_win_plus_half_tie_both_orders_and_sums_to_one(tokenizer):
    """a says yes, b says no, one round: P(a wins) is 0.8 as first and 0.7 as second, ties 0.1 each,
    so a's reward is ((0.8 + 0.05) + (0.7 + 0.05)) / 2 = 0.8 and b's 0.2. In self-play both roles say
    the same: a draw, and no match (a policy against itself rates nothing). Wrong: the tie counted as
    a loss, the orders not averaged, or rewards that do not sum to 1."""
    sample, _ = scripted_engines(tokenizer, lambda p, call, j: YES if p == "a" else NO)
    played = asyncio.run(
        play_together(debate(rounds=1), seating(tokenizer, {"first": "a", "second": "b"}), sample,
                      [("q",)], [{}], 2, 0, prefers_yes([]))
    )  # fmt: skip
    assert [r["first"] for r in played["a"].rewards] == [pytest.approx(0.8)] * 2
    assert [r["second"] for r in played["b"].rewards] == [pytest.approx(0.2)] * 2
    assert played["a"].matches == [("a", "b", pytest.approx(0.8))] * 2
    alone = asyncio.run(
        play_together(debate(rounds=1), seating(tokenizer, {"first": "a", "second": "a"}), sample,
                      [("q",)], [{}], 2, 0, prefers_yes([]))
    )  # fmt: skip
    assert alone["a"].row_roles == ["first", "first", "second", "second"]
    assert [list(r.values())[0] for r in alone["a"].rewards] == pytest.approx([0.5] * 4)
    assert alone["a"].matches == []


def test_a_debate_without_a_pair_judge_is_one_line_before_any_actor_starts():
    """The `remote` reward scores answers one by one: a debate needs verdicts on pairs, so the recipe
    is refused naming the reward's key (exit 2 in `hpref rl`), as is a negative weight; the rule
    reward, which judges pairs, passes, self-play too. Wrong: a run that starts and fails at its
    first rollout, or a silent pointwise reward."""
    check_cast(config(), ["a", "b"], "r.toml")
    check_cast(config({"first": "a", "second": "a"}, policies=("a",)), ["a"], "r.toml")
    with pytest.raises(
        RecipeError, match=r"^r.toml: rl.reward: the 'debate' environment's episodes are judged"
    ):
        cfg = parse_rl_section(
            {
                "reward": {"name": "remote", "url": "http://127.0.0.1:9"},
                "environment": {"name": "debate", "roles": {"first": "a", "second": "b"}},
                "defaults": {"model": TINY},
                "policies": {"a": {}, "b": {}},
            },
            "r.toml",
        )
        check_cast(cfg, ["a", "b"], "r.toml")
    with pytest.raises(RecipeError, match=r"weight is -1: the 'debate' environment's verdicts"):
        cfg = parse_rl_section(
            {
                "rewards": {"x": {"name": "rule", "weight": 1.0}, "y": {"name": "rule", "weight": -1.0}},
                "environment": {"name": "debate", "roles": {"first": "a", "second": "b"}},
                "defaults": {"model": TINY},
                "policies": {"a": {}, "b": {}},
            },
            "r.toml",
        )
        check_cast(cfg, ["a", "b"], "r.toml")


def test_weighted_battles_rate_as_the_same_battles_one_by_one():
    """The live table keeps {player: {opponent: [games, summed score]}}; fitted as weighted battles
    it must rate exactly as the battles given one by one. Wrong: a table whose ratings depend on
    how the matches were counted (a resumed run would rate differently from one never stopped)."""
    battles = [("a", "b", 0.8), ("a", "b", 0.6), ("b", "a", 0.3), ("a", "a@start", 0.9)]
    standings = {"a": {"b": [2.0, 1.4], "a@start": [1.0, 0.9]}, "b": {"a": [1.0, 0.3]}}
    players = ["a", "b", "a@start"]
    one_by_one = bradley_terry(players, battles)
    weighted = bradley_terry(players, table_battles(standings))
    assert weighted == pytest.approx(one_by_one, abs=1e-6)
    assert one_by_one["a"] > one_by_one["b"] and one_by_one["a"] > one_by_one["a@start"]


def test_a_debate_run_trains_both_sides_on_the_verdict_and_keeps_a_live_table(tmp_path):
    """Two tiny policies debate for 3 rollouts, judged by the arena's rule judge, in process: every
    rollout of each is trained on (rewards of the two sides summing to 1 per episode), a's rows carry
    the matches and their mean score, the live table is refitted and logged after each of a's rollouts
    with both players, `rl_summary`'s leaderboard comes from the same matches, and a save keeps the
    standings for a resume. Wrong: a side trained on its partner's reward, matches counted twice or
    lost by a save, or a table that appears only at evals."""
    from hpref.rl.control.driver import Handles, drive
    from hpref.rl.engines.transformers_engine import EngineActor
    from hpref.rl.report.metrics import MetricsWriter
    from hpref.rl.rollout.executor import RolloutExecutor
    from hpref.rl.trainer.actor import TrainerActor
    from tests.rl.local_actor import LocalActor

    cfg = config(num_rollouts=3, eval_interval=0, save_interval=0)
    engines = {p: LocalActor(EngineActor(p, cfg.policies[p].model)) for p in "ab"}
    executor = RolloutExecutor(cfg, ["a", "b"], engines)
    trainers = {p: LocalActor(TrainerActor(p, cfg.policies[p], 1)) for p in "ab"}
    handles = Handles(LocalActor(executor), engines, trainers)
    logged = []

    class Recording(MetricsWriter):
        def log_leaderboard(self, leaderboard, step):
            logged.append((step, dict(leaderboard)))

    metrics = Recording(None)
    result = asyncio.run(drive(cfg, ["a", "b"], handles, tmp_path / "run", {"a": 0, "b": 0}, metrics))
    a, b = metrics.rows["a"], metrics.rows["b"]
    # the follower plays in lockstep, never a rollout ahead of a; it goes on until the leader's stop
    assert [r["rollout"] for r in a] == [0, 1, 2] and [r["rollout"] for r in b] == list(range(len(b)))
    assert 2 <= len(b) <= 4
    for ra, rb in zip(a, b[:3], strict=False):  # the same episodes: each side's mean reward sums to 1
        assert ra["reward_mean"] + rb["reward_mean"] == pytest.approx(1.0)
        assert ra["matches"] == 4 and ra["match_score_mean"] == pytest.approx(ra["reward_mean"])
        assert "matches" not in rb  # each match is a's (the first judged role), counted once
    assert [step for step, _ in logged] == [0, 1, 2] and all(set(t) == {"a", "b"} for _, t in logged)
    games = result.standings["a"]["b"]
    assert games[0] == 12.0 and games[1] == pytest.approx(sum(r["reward_mean"] * 4 for r in a))
    assert result.leaderboard(["a", "b"]) == logged[-1][1]
    from hpref.rl.launch import leaderboard_sources

    assert leaderboard_sources(result) == "judged matches"  # rl_summary's `leaderboard_by`: no eval ran
    asyncio.run(executor.save(str(tmp_path / "save")))
    fresh = RolloutExecutor(cfg, ["a", "b"], engines)
    asyncio.run(fresh.load(str(tmp_path / "save")))
    assert fresh.standings == executor.standings == result.standings
