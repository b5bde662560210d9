"""`propose-solve` (#50): the proposer's turn is played once per start and shared by the start's
episodes (`SharedTurn`), each episode one solver attempt at that problem; the proposer is rewarded
1 - |2 s - 1| for a well-formed problem (s: the start's solve rate), the solver for being right; the
proposer's rollout is one row per start, one group. Scripted engines and pure Python in
milliseconds; one in-process drive of two tiny policies (a few seconds)."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

pytest.importorskip("torch")

from hpref.errors import RecipeError  # noqa: E402
from hpref.plugins import load_plugins  # noqa: E402
from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.control.preflight import check_cast  # noqa: E402
from hpref.rl.environments.propose_solve import ProposeSolveConfig, read_problem  # noqa: E402
from hpref.rl.protocols import SharedTurn  # noqa: E402
from hpref.rl.rollout.joint import first_role, play_together  # noqa: E402
from hpref.rl.rollout_types import Turn  # noqa: E402
from tests.rl.environments.test_together import scripted_engines, seating  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402

ROLES = {"proposer": "a", "solver": "b"}


def propose_solve(**params):
    return load_plugins().get("environment", "propose-solve").build(ProposeSolveConfig(**params))


def config(roles=None, policies=("a", "b"), rollout=None, **rl):
    return parse_rl_section(
        {
            "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 6, **(rollout or {})},
            "environment": {"name": "propose-solve", "roles": roles or ROLES},
            "defaults": {"model": TINY},
            "policies": {p: {} for p in policies},
            **rl,
        },
        "r.toml",
    )


@pytest.fixture(scope="module")
def tokenizer():
    from hpref.models.causal_lm import policy_tokenizer

    return policy_tokenizer(config().policies["a"].model)


def played_start(proposal, answers, finished=True):
    """One start's episodes played by hand: the proposer's one turn shared, then each answer."""
    env = propose_solve()
    episodes = [env.start(("p",), {}, k) for k in range(len(answers))]
    for episode, answer in zip(episodes, answers, strict=True):
        step = episode.step(Turn("proposer", proposal, (1,), finished))
        if not step.done:
            assert episode.actor() == "solver"
            assert episode.step(Turn("solver", answer, (1,), True)).done
    return env.start_rewards(episodes)


def test_the_problem_is_asked_once_per_start_and_every_attempt_sees_it(tokenizer):
    """Two starts, three episodes each: the proposer's engine is asked once per start (2 contexts,
    not 6), the solver's once with all 6 attempts, each attempt's opening showing its start's
    problem; the proposer has one row per start, the solver `group` per start; rewards: start 0 is
    solved 2 of 3 times (proposer 1 - |4/3 - 1| = 2/3), start 1 always (proposer 0). Wrong: the
    problem sampled per episode (s would mix different problems), an attempt shown another start's
    problem, or the proposer's turn trained on three times."""
    problems = ["Problem: 6 * 7\nAnswer: 42", "Problem: 2 + 2\nAnswer: 4"]
    said = ["42", "41", "the answer is 42", "4", "4", "4.0"]
    sample, calls = scripted_engines(tokenizer, lambda p, call, j: problems[j] if p == "a" else said[j])
    seats = seating(tokenizer, ROLES)
    played = asyncio.run(play_together(propose_solve(), seats, sample, [("p0",), ("p1",)], [{}, {}], 3, 7))
    assert [(c[0], len(c[1])) for c in calls] == [("a", 2), ("b", 6)]
    a, b = played["a"], played["b"]
    assert a.row_roles == ["proposer"] * 2 and a.texts == problems
    assert b.row_roles == ["solver"] * 6 and b.texts == said
    shown = [tokenizer.decode(ids) for ids in b.prompt_ids]
    assert all("What is 6 * 7?" in s for s in shown[:3]) and all("What is 2 + 2?" in s for s in shown[3:])
    assert [r["proposer"] for r in a.rewards] == [pytest.approx(2 / 3), 0.0]
    assert [r["solver"] for r in b.rewards] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert b.stats.success == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert a.tokens == sum(len(c) for c in a.completions) and len(a.completions) == 2
    # an eval plays one episode per prompt: the proposer's row per prompt, read in its first role
    sample, calls = scripted_engines(tokenizer, lambda p, call, j: problems[j] if p == "a" else "42")
    one = asyncio.run(play_together(propose_solve(), seats, sample, [("p0",), ("p1",)], [{}, {}], 1, 7))
    assert [(c[0], len(c[1])) for c in calls] == [("a", 2), ("b", 2)]
    assert first_role(one["a"], 2).texts == problems and one["b"].stats.success == [1.0, 0.0]


def test_a_problem_that_is_not_well_formed_ends_every_attempt_with_nothing_to_solve(tokenizer):
    """A proposal whose stated answer is wrong: no solver is asked, each attempt's solver row is its
    opening alone (no tokens, reward 0), the proposer's reward 0. Wrong: a solver rewarded for
    agreeing with a wrong answer, or an engine asked to solve nothing."""
    sample, calls = scripted_engines(tokenizer, lambda p, call, j: "Problem: 2 + 2\nAnswer: 5")
    seats = seating(tokenizer, ROLES)
    played = asyncio.run(play_together(propose_solve(), seats, sample, [("p0",), ("p1",)], [{}, {}], 2, 0))
    assert [c[0] for c in calls] == ["a"]
    assert played["b"].completions == [[]] * 4 and played["b"].masks == [[]] * 4
    assert [r["solver"] for r in played["b"].rewards] == [0.0] * 4
    assert [r["proposer"] for r in played["a"].rewards] == [0.0, 0.0]


@pytest.mark.parametrize(
    ("answers", "proposer"),
    [
        (["1", "2", "3", "5"], 0.0),  # s = 0: too hard
        (["4", "four", "4", "3"], 1.0),  # s = 1/2: the most uncertain
        (["4", "4.0", "it is 4", "4"], 0.0),  # s = 1: too easy
        (["4", "4", "4", "1"], 0.5),  # s = 3/4: 1 - |3/2 - 1|
    ],
)
def test_the_proposers_reward_is_highest_where_the_solver_is_right_half_the_time(answers, proposer):
    """R-Zero's uncertainty reward over the start's four attempts at "2 + 2": 1 - |2 s - 1|, and
    each attempt's solver reward its own rightness (the last number is the answer). Wrong: a
    proposer paid for problems nobody or everybody solves, or a solver paid for its partners."""
    rewards = played_start("Problem: 2 + 2\nAnswer: 4", answers)
    assert [r["proposer"] for r in rewards] == [pytest.approx(proposer)] * 4
    right = [float(a.split()[-1] in ("4", "4.0")) for a in answers]
    assert [r["solver"] for r in rewards] == right


@pytest.mark.parametrize(
    "proposal",
    [
        "Problem: 2 + 2\nAnswer: 5",  # the proposer's own answer is wrong
        "Problem: 2 + 2",  # no answer
        "Answer: 4",  # no problem
        "Problem: two plus two\nAnswer: 4",  # not an expression the calculator takes
        "Problem: 2 ** 0.5\nAnswer: 1.41",  # irrational: no exact value
        "Problem: 1 / 0\nAnswer: 0",  # division by zero
    ],
)
def test_a_problem_that_is_not_well_formed_earns_the_proposer_nothing(proposal):
    """Even when the solvers "solve" it half the time, an ill-formed problem pays 0, and the episode
    ends before any solver turn. Wrong: a proposer paid for problems it cannot answer itself."""
    rewards = played_start(proposal, ["4", "5"])
    assert rewards == [{"proposer": 0.0, "solver": 0.0}] * 2


def test_a_proposal_cut_at_max_new_tokens_is_not_judged():
    """A proposal cut short ("Answer: 4" of what may have been 42) is not well formed. Wrong: a
    truncated answer line read as the proposer's answer."""
    assert played_start("Problem: 2 + 2\nAnswer: 4", ["4", "5"], finished=False)[0]["proposer"] == 0.0
    assert played_start("Problem: 2 + 2\nAnswer: 4", ["4", "5"], finished=True)[0]["proposer"] == 1.0


def test_a_problem_is_read_exactly():
    """Labels in any case, the value exact (fractions and decimals), the answer line's last number.
    Wrong: a float comparison (0.1 + 0.2 != 0.3) or a problem's text with the label left in."""
    assert read_problem("problem: 0.1 + 0.2\nanswer: 0.3") == ("0.1 + 0.2", Fraction(3, 10))
    assert read_problem("Sure!\nProblem: 1/3 + 1/6\nAnswer: 1/2") == ("1/3 + 1/6", Fraction(1, 2))
    assert read_problem("Problem: (12 + 7) * 3\nAnswer: 19 * 3 = 57") == ("(12 + 7) * 3", Fraction(57))
    assert read_problem("Problem: 1/3\nAnswer: 0.333") is None


def test_a_shared_role_that_does_not_act_first_is_an_error_not_a_lost_turn(tokenizer):
    """An environment whose shared role acts second: its turn in a start's later episodes would come
    after turns that differ per episode, and the start's one row could not hold them; the runner says
    so. Wrong: a later episode that silently never takes the turn (it would wait forever)."""
    from hpref.rl.rollout_types import Step

    class LateEpisode:
        def __init__(self):
            self.said = []

        def actor(self):
            return "x" if not self.said else "y"

        def step(self, turn):
            self.said.append(turn.text)
            return Step(done=len(self.said) == 2, observation=None, role="user")

        def rewards(self):
            return None

        def success(self):
            return None

    class Late:
        name, roles, shared_role = "late", ("x", "y"), "y"

        def start(self, prompt, row, seed):
            return LateEpisode()

        def start_rewards(self, episodes):
            return [{"x": 0.0, "y": 0.0} for _ in episodes]

    sample, _ = scripted_engines(tokenizer, lambda p, call, j: "hi")
    seats = seating(tokenizer, {"x": "a", "y": "b"})
    with pytest.raises(RuntimeError, match=r"environment 'late': 'y' must act once, first"):
        asyncio.run(play_together(Late(), seats, sample, [("p",)], [{}], 2, 0))


def test_propose_solve_shares_its_proposers_turn():
    """The capability the joint runner and the executor ask for. Wrong: the proposer sampled per
    episode (no solve rate of one problem)."""
    env = propose_solve()
    assert isinstance(env, SharedTurn) and env.shared_role == "proposer"
    assert env.roles == ("proposer", "solver")


@pytest.mark.parametrize(
    ("cfg", "policies", "message"),
    [
        (
            lambda: config(rollout={"prompts_per_rollout": 1}),
            ["a", "b"],
            r"^r.toml: rl.rollout.prompts_per_rollout is 1: the 'propose-solve' environment's 'proposer'",
        ),
        (
            lambda: config({"proposer": "a", "solver": "a"}, policies=("a",)),
            ["a"],
            r"^r.toml: rl.environment.roles.solver: 'a' plays 'proposer' too",
        ),
        (lambda: config(rollout={"group_size": 1}), ["a", "b"], r"group_size"),
        (
            lambda: parse_rl_section(
                {
                    "environment": {"name": "propose-solve", "roles": ROLES, "solver_prompt": "Solve it."},
                    "defaults": {"model": TINY},
                    "policies": {"a": {}, "b": {}},
                },
                "r.toml",
            ),
            ["a", "b"],
            r"^r.toml: rl.environment.solver_prompt: .*put \{problem\} in it",
        ),
    ],
)
def test_a_recipe_propose_solve_cannot_run_is_one_line_before_any_actor_starts(cfg, policies, message):
    """One start per rollout (the proposer's group of one: no advantage), one policy in both roles
    (two group sizes in one rollout), one attempt per problem (no solve rate), a solver that is not
    shown the problem: each refused naming its key. Wrong: a run that starts and learns nothing, or
    fails at its first rollout."""
    with pytest.raises(RecipeError, match=message):
        check_cast(cfg(), policies, "r.toml")
    check_cast(config(), ["a", "b"], "r.toml")


def relabelled(policy, model, said):
    """A tiny policy's engine whose every turn reads as `said[row]`: it samples as usual and keeps
    at most the first 3 tokens it drew (a prefix of its own draw, so their log-probs are exact and the
    turn ends), only the text is given. A random tiny model never writes a problem: this one does."""
    from hpref.rl.engines.transformers_engine import EngineActor

    class Relabelled(EngineActor):
        def generate_batch(self, requests):
            outs = super().generate_batch(requests)
            for out in outs:
                out.completions = [c[:3] for c in out.completions]
                out.logprobs = [lp[:3] for lp in out.logprobs]
                out.texts = [said[j] for j in range(len(out.texts))]
                out.tokens = sum(map(len, out.completions))
            return outs

    return Relabelled(policy, model)


def test_a_propose_solve_run_trains_both_policies_with_a_row_per_start_for_the_proposer(tmp_path, tokenizer):
    """Two tiny policies play propose-solve for 2 rollouts of 3 starts in process, both trained. The
    proposer (a) writes "3 + 4" (answer 7), nonsense, "2 * 5" (answer 10); the solver (b) answers 7,
    8, 10, 10 to the problems it gets. So each of a's rollouts is one row per start with `group_size`
    = the starts (3, not the 2 attempts) and rewards [1, 0, 0] (solved half the time, not well
    formed, always solved), b's is 2 attempts per start, rewards [1, 0, 0, 0, 1, 1] (start 1's never
    played: no tokens), and both policies' weights move (a gradient). Wrong: the proposer's rows
    grouped per start (a group of one: no advantage), its turn sampled per attempt, the solve rate
    taken over the wrong episodes, or a rollout that does not train."""
    from hpref.rl.control.driver import Handles, drive
    from hpref.rl.report.metrics import MetricsWriter
    from hpref.rl.rollout.executor import RolloutExecutor
    from hpref.rl.trainer.actor import TrainerActor
    from tests.rl.local_actor import LocalActor

    cfg = config(rollout={"prompts_per_rollout": 3}, num_rollouts=2, eval_interval=0, save_interval=0)
    problems = ["Problem: 3 + 4\nAnswer: 7", "Problem: seven\nAnswer: 7", "Problem: 2 * 5\nAnswer: 10"]
    said = {"a": problems, "b": ["7", "8", "10", "10"]}
    engines = {p: LocalActor(relabelled(p, cfg.policies[p].model, said[p])) for p in "ab"}
    executor = RolloutExecutor(cfg, ["a", "b"], engines)
    taken = []
    get = executor.get

    async def recording_get(rollout_id, policy):
        rollout = await get(rollout_id, policy)
        taken.append(rollout)
        return rollout

    executor.get = recording_get
    trainers = {p: LocalActor(TrainerActor(p, cfg.policies[p], 1)) for p in "ab"}
    handles = Handles(LocalActor(executor), engines, trainers)
    metrics = MetricsWriter(None)
    asyncio.run(drive(cfg, ["a", "b"], handles, tmp_path / "run", {"a": 0, "b": 0}, metrics))
    a, b = metrics.rows["a"], metrics.rows["b"]
    assert [r["rollout"] for r in a] == [0, 1] and len(b) >= 2
    proposer = [r for r in taken if r.policy == "a"]
    solver = [r for r in taken if r.policy == "b"]
    assert len(proposer) == 2 and len(solver) >= 2
    for rollout in proposer:
        assert rollout.group_size == 3 and [0 < len(c) <= 3 for c in rollout.completions] == [True] * 3
        assert rollout.rewards == [1.0, 0.0, 0.0]
    for rollout in solver:
        assert rollout.group_size == 2 and [len(c) > 0 for c in rollout.completions] == [1, 1, 0, 0, 1, 1]
        assert rollout.rewards == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
        assert "What is 3 + 4?" in tokenizer.decode(rollout.prompt_ids[1])
        assert "What is 2 * 5?" in tokenizer.decode(rollout.prompt_ids[5])
    assert all(r["grad_norm"] > 0 for r in a) and all(r["grad_norm"] > 0 for r in b)
