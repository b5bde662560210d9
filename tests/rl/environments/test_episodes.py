"""Episodes (`[rl.environment]`, `hpref.rl.rollout.episodes`): token-exact turns, the mask the trainer
trains on, the bounds, one engine call per turn, single-turn exactly as before, and a tiny policy
that learns in a two-turn environment. In-process (LocalActor), tiny models: seconds each."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from hpref.models.causal_lm import observation_ids, policy_tokenizer, turn_end_id  # noqa: E402
from hpref.plugins import load_plugins, reset_plugins  # noqa: E402
from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.engines.transformers_engine import EngineActor  # noqa: E402
from hpref.rl.rollout.episodes import Bounds, TurnCodec, play_episodes, turn_seed  # noqa: E402
from hpref.rl.rollout.executor import RolloutExecutor  # noqa: E402
from hpref.rl.rollout.prompts import build_prompt_source, rollout_prompts, sample_seed  # noqa: E402
from hpref.rl.rollout_types import Generation  # noqa: E402
from hpref.rl.trainer.actor import TrainerActor  # noqa: E402
from tests.rl.environments import turns  # noqa: E402
from tests.rl.local_actor import LocalActor  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def repeat_registered():
    """The test environments beside the built-ins, for this module only."""
    load_plugins(extra=[turns])
    yield
    reset_plugins()


def config(environment=None, **over):
    section = {
        "num_rollouts": 2,
        "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6},
        "reward": {"name": "rule"},
        "defaults": {"model": TINY, "lr": 1e-3},
        "policies": {"a": {}},
        **over,
    }
    if environment is not None:
        section["environment"] = environment
    return parse_rl_section(section, "test")


@pytest.fixture(scope="module")
def tokenizer():
    return policy_tokenizer(config().policies["a"].model)


def scripted(completions, logprobs, prompt_ids, texts=None, version=0):
    return Generation(
        prompt_ids=prompt_ids,
        completions=completions,
        logprobs=logprobs,
        texts=texts or [f"t{len(c)}" for c in completions],
        version=version,
        tokens=sum(map(len, completions)),
        seconds=0.5,
    )


def test_turns_keep_the_policys_tokens_and_observations_are_masked_context(tokenizer):
    """Two prompts x 2 episodes of `repeat` (3 turns, observation "again") under max_turns 3: each
    later turn's context is the prompt, then the policy's earlier tokens exactly as generated, a
    closing eos only after a turn cut at max_new_tokens, and the template's observation tokens; one
    engine call per turn with every live episode; the mask is 1 on the policy's tokens alone and the
    log-probs are theirs. Wrong: re-encoded turns (the drift verl documents), observations trained
    on, or one engine call per episode."""
    env = load_plugins().get("environment", "repeat").build(turns.RepeatConfig(turns=3))
    eos, max_new = turn_end_id(tokenizer), 4
    obs = observation_ids(tokenizer, "user", "again")
    prompts = [("p0",), ("p1",)]
    prompt_ids = [[1, 2], [1, 2], [1, 3], [1, 3]]
    # turn 1: episode 0 ends at its eos, 1 is cut at max_new (4 tokens, no eos), 2 and 3 short
    first = [[10, eos], [11, 12, 13, 14], [15, eos], [16, eos]]
    calls = []

    async def first_turn():
        return scripted(first, [[-0.1 * (k + 1) for k in range(len(c))] for c in first], prompt_ids)

    async def next_turn(live, contexts, seed):
        calls.append((list(live), [list(c) for c in contexts], seed))
        out = [[20 + len(calls), eos] for _ in contexts]
        return scripted(out, [[-1.0, -2.0] for _ in out], contexts, version=len(calls))

    bounds = Bounds("policy", max_turns=3, max_context_tokens=512, max_new_tokens=max_new)
    played = asyncio.run(
        play_episodes(
            env, TurnCodec(lambda: tokenizer), first_turn, next_turn, prompts, [{}, {}], 2, 7, bounds
        )
    )
    assert len(calls) == 2  # one call per later turn, all four episodes in each
    assert [len(c[1]) for c in calls] == [4, 4]
    assert calls[0][0] == [("p0",), ("p0",), ("p1",), ("p1",)]
    assert calls[0][2] == turn_seed(7, 1) and calls[1][2] == turn_seed(7, 2)
    # the second turn's contexts: the policy's tokens as generated, eos added only to the cut turn
    assert calls[0][1][0] == [1, 2, 10, eos, *obs]
    assert calls[0][1][1] == [1, 2, 11, 12, 13, 14, eos, *obs]
    second = [21, eos]
    assert calls[1][1][0] == [1, 2, 10, eos, *obs, *second, *obs]
    assert played.completions[0] == [10, eos, *obs, *second, *obs, 22, eos]
    assert played.masks[0] == [1, 1] + [0] * len(obs) + [1, 1] + [0] * len(obs) + [1, 1]
    assert played.masks[1] == [1, 1, 1, 1, 0] + [0] * len(obs) + [1, 1] + [0] * len(obs) + [1, 1]
    assert played.logprobs[0] == pytest.approx([-0.1, -0.2, -1.0, -2.0, -1.0, -2.0])
    assert played.tokens == sum(map(sum, played.masks)) == 2 + 4 + 2 + 2 + 4 * 4
    assert played.stats.turns == [3, 3, 3, 3] and played.stats.truncated == [False] * 4
    assert played.version == 0 and played.seconds == pytest.approx(1.5)  # the oldest version
    assert played.rewards[0] == {"policy": -float(len("t2") * 3)}  # the environment's reward
    assert played.transcripts[0][:3] == [("policy", "t2"), ("user", "again"), ("policy", "t2")]
    assert not played.single_turn


@pytest.mark.parametrize("bound", ["turns", "context"])
def test_an_episode_past_a_bound_ends_is_kept_and_counted_truncated(tokenizer, bound):
    """`repeat` wants 5 turns; max_turns 2, or a context bound that leaves room for the first
    observation but not the second: the episode ends after its second turn, keeps what it did (no
    trailing observation) and is counted truncated. Wrong: an episode run past its bound (an engine
    context overflow on a real model), dropped, or silently reported as finished."""
    env = load_plugins().get("environment", "repeat").build(turns.RepeatConfig(turns=5))
    eos = turn_end_id(tokenizer)
    obs = observation_ids(tokenizer, "user", "again")

    async def first_turn():
        return scripted([[10, eos]], [[-0.5, -0.5]], [[1, 2]])

    async def next_turn(live, contexts, seed):
        return scripted([[11, eos]], [[-0.5, -0.5]], contexts)

    if bound == "turns":
        bounds = Bounds("policy", max_turns=2, max_context_tokens=4096, max_new_tokens=4)
    else:  # room for prompt + turn + obs + 4 new, not for a second observation and 4 more
        bounds = Bounds("policy", max_turns=9, max_context_tokens=2 + 2 + len(obs) + 4 + 3, max_new_tokens=4)
    codec = TurnCodec(lambda: tokenizer)
    played = asyncio.run(play_episodes(env, codec, first_turn, next_turn, [("p",)], [{}], 1, 0, bounds))
    assert played.stats.truncated == [True] and played.stats.turns == [2]
    assert played.completions[0] == [10, eos, *obs, 11, eos]  # trained on as far as it went
    assert played.masks[0][-2:] == [1, 1]


def test_a_role_the_environment_does_not_have_and_bad_bounds_are_one_line():
    """The recipe's environment keys are checked when it loads, and the roles before any actor
    starts. Wrong: a typo that runs the default, or a KeyError inside the executor."""
    from hpref.errors import RecipeError
    from hpref.rl.environments.registry import check_environment

    with pytest.raises(RecipeError, match=r"rl.environment.max_turns: Input should be greater than or equal"):
        config({"name": "repeat", "max_turns": 0})
    with pytest.raises(RecipeError, match=r"rl.environment.tunrs: unknown key"):
        config({"name": "repeat", "tunrs": 3})
    with pytest.raises(RecipeError, match=r"roles.judge: the 'repeat' environment has no role 'judge'"):
        check_environment(config({"name": "repeat", "roles": {"judge": "a"}}), ["a"], "test")
    with pytest.raises(RecipeError, match=r"rl.environment.roles.policy: 'zz' is no policy of the recipe"):
        check_environment(config({"name": "repeat", "roles": {"policy": "zz"}}), ["a"], "test")
    with pytest.raises(RecipeError, match=r"max_context_tokens: 4096 tokens is past policy 'a''s"):
        check_environment(config({"name": "repeat", "max_context_tokens": 4096}), ["a"], "test")


@pytest.fixture(scope="module")
def engine():
    return EngineActor("a", config().policies["a"].model)


def test_single_turn_rollouts_are_the_engines_answers_and_rewards_as_before(engine):
    """With no `[rl.environment]` (and with `single-turn` named), a rollout is exactly what it was
    before environments: the engine's one `generate` with the rollout's seed, scored by the run's
    reward, no mask, no episode stats; and a trainer step on it leaves the same weights as one on an
    all-ones mask. Wrong: the default path changed what every existing recipe trains on."""
    cfg = config()
    prompts = rollout_prompts(build_prompt_source(cfg), cfg.rollout, 0)
    seed = sample_seed(cfg.rollout.seed, "a", 0)
    before = engine.generate(prompts, 2, 6, cfg.rollout.temperature, cfg.rollout.top_k, seed)

    async def produce(c):
        ex = RolloutExecutor(c, ["a"], {"a": LocalActor(engine)})
        rollout = await ex.get(0, "a")
        await ex.shutdown()
        return rollout, ex.reward

    for c in (cfg, config({"name": "single-turn"})):
        rollout, reward = asyncio.run(produce(c))
        assert rollout.completions == before.completions and rollout.logprobs == before.logprobs
        assert rollout.prompt_ids == before.prompt_ids and rollout.texts == before.texts
        groups = [before.texts[i * 2 : (i + 1) * 2] for i in range(len(prompts))]
        assert rollout.rewards == [float(s) for g in reward.score_groups(prompts, groups) for s in g]
        assert rollout.masks is None and rollout.episodes is None
    trained = []
    for masks in (None, [[1] * len(c) for c in rollout.completions]):
        trainer = TrainerActor("a", cfg.policies["a"], 1)
        trainer.train(dataclasses.replace(rollout, masks=masks))
        trained.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_a_two_turn_rollout_trains_on_the_policys_tokens_with_the_engines_logprobs(engine):
    """A real tiny engine plays `repeat` (2 turns, the observation as a tool message): the trainer's
    log-probs of the policy's tokens, teacher-forced over the whole transcript, match the engine's
    within float rounding (the context is the tokens the engine saw), it trains on those tokens
    alone, and the eval saves each transcript whole, each message with its role. Wrong: a context
    that differs from what the engine continued (the ratio drifts off 1), or observations counted."""
    cfg = config({"name": "repeat", "turns": 2, "role": "tool"}, eval_interval=1)

    async def main():
        ex = RolloutExecutor(cfg, ["a"], {"a": LocalActor(engine)})
        rollout = await ex.get(0, "a")
        report = await ex.evaluate(["a"])
        await ex.shutdown()
        return rollout, report

    rollout, report = asyncio.run(main())
    assert rollout.masks is not None and rollout.episodes is not None
    assert rollout.episodes.turns == [2] * 4
    assert all(0 in m for m in rollout.masks)  # observations inside every row
    assert [len(lp) for lp in rollout.logprobs] == [sum(m) for m in rollout.masks]
    assert all(r <= -len(t) for r, t in zip(rollout.rewards, rollout.texts, strict=True))  # both turns'
    stats = TrainerActor("a", cfg.policies["a"], 1).train(rollout)
    assert stats["train_tokens"] == sum(map(sum, rollout.masks)) < sum(map(len, rollout.completions))
    assert stats["engine_trainer_logprob_diff"] < 1e-4
    assert stats["engine_trainer_logprob_diff_max"] < 1e-3
    row = report["answers"]["a"][0]
    assert [m["role"] for m in row["transcript"]] == ["policy", "tool", "policy"]
    assert row["transcript"][1]["text"] == "again" and row["turns"] == 2


def test_per_turn_advantages_are_one_per_episode_when_every_episode_takes_the_same_turns(engine):
    """GRPO's per-turn advantages (`turn_advantages`, on by default): on a two-turn rollout whose
    turns carry no reward of their own, every turn's reward-to-go is its episode's, so a step with
    them leaves the weights bit for bit where one advantage per episode leaves them; with a reward on
    the first turns (a tool call that ran), the first turns' advantages move and the step differs.
    Wrong: the per-turn path reads a token's turn wrongly (its own tokens, or context) or changes what
    an episode of equal turns trains on."""
    from hpref.rl.algorithms.registry import build_algorithm

    cfg = config({"name": "repeat", "turns": 2, "role": "tool"})

    async def main():
        ex = RolloutExecutor(cfg, ["a"], {"a": LocalActor(engine)})
        rollout = await ex.get(0, "a")
        await ex.shutdown()
        return rollout

    played = asyncio.run(main())
    assert played.episodes.turn_steps is not None and all(len(t) == 2 for t in played.episodes.turn_steps)
    rows = len(played.completions)
    plain = dataclasses.replace(
        played, episodes=dataclasses.replace(played.episodes, turn_steps=[[0.0, 0.0]] * rows)
    )
    trained = []
    for per_turn in (True, False):
        algorithm = {"name": "grpo", "turn_advantages": per_turn}
        policy = config(defaults={"model": TINY, "lr": 1e-3, "algorithm": algorithm}).policies["a"]
        assert build_algorithm("a", policy, "test").turns_of(plain) == (
            [[0.0, 0.0]] * rows if per_turn else None
        )
        trainer = TrainerActor("a", policy, 1)
        trainer.train(plain)
        trained.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    # RLOO keeps the returns' scale (two GRPO-normalised values are always +-0.71): a reward on the
    # first turns lowers the second turns' reward-to-go, so those tokens step otherwise
    rloo = config(defaults={"model": TINY, "lr": 1e-3, "algorithm": {"name": "grpo", "advantage": "rloo"}})
    credited = dataclasses.replace(
        played,
        episodes=dataclasses.replace(played.episodes, turn_steps=[[0.5, 0.0], [0.0, 0.0]] * (rows // 2)),
    )
    after = []
    for rollout in (plain, credited):
        trainer = TrainerActor("a", rloo.policies["a"], 1)
        trainer.train(rollout)
        after.append(trainer.model.state_dict())
    assert any(not torch.equal(after[0][k], after[1][k]) for k in after[0])


def test_a_tiny_policy_learns_in_a_two_turn_environment(tmp_path):
    """GRPO on `repeat` (2 turns, reward minus the characters written over both turns): a random
    tiny policy rambles in both turns, and within 30 updates its episodes' reward must rise to near
    0. If observation tokens were trained on, advantages reached the wrong tokens, or the second
    turn's context were not what the engine continued, the reward would not rise this way."""
    from hpref.rl.control.driver import Handles, drive
    from hpref.rl.report.metrics import MetricsWriter

    cfg = config(
        {"name": "repeat", "turns": 2},
        num_rollouts=30,
        rollout={"group_size": 4, "prompts_per_rollout": 2, "max_new_tokens": 8},
        defaults={"model": TINY, "lr": 3e-2},
    )
    engines = {"a": LocalActor(EngineActor("a", cfg.policies["a"].model))}
    handles = Handles(
        LocalActor(RolloutExecutor(cfg, ["a"], engines)),
        engines,
        {"a": LocalActor(TrainerActor("a", cfg.policies["a"], cfg.update_weights_interval))},
    )
    played = []  # every batch of episodes the executor played: their turns' weight versions
    players = handles.executor.wrapped.players
    real_play = players.play

    async def play(*args, **kwargs):
        played.append(out := await real_play(*args, **kwargs))
        return out

    players.play = play
    real_continue = players._continue

    async def late(*args, **kwargs):  # a later turn that comes after the trainer's step and push would
        await asyncio.sleep(0.1)
        return await real_continue(*args, **kwargs)

    players._continue = late
    metrics = MetricsWriter(None)
    asyncio.run(drive(cfg, ["a"], handles, tmp_path / "run", {"a": 0}, metrics))
    # the driver pushed every update, and no push came between two turns of a prefetched episode
    # (`Driver.step` settles them first): each rollout's turns are of the one version it reports
    assert len(played) >= 30 and all(p.newest == p.version for p in played)
    assert [row["weight_version"] for row in metrics.rows["a"]] == list(range(1, 31))
    rows = metrics.rows["a"]
    rewards = [row["reward_mean"] for row in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < -10.0, rewards  # two rambling turns
    assert last > -4.0, rewards  # measured: -16.5 at the start, 0.0 (empty turns) by update 28
    assert all(row["turns_mean"] == 2.0 and row["truncated_share"] == 0.0 for row in rows)
    assert rows[0]["success"] == 0.0 and sum(row["success"] for row in rows[-3:]) / 3 >= 0.5
