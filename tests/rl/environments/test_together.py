"""Policies that meet (`hpref.rl.rollout.joint`): an environment's roles seated by different policies
(or one policy in several: self-play), each role's transcript in its policy's own tokens, one engine
request per policy per round, rows grouped per start and role; the `signal` game; the recipe's
casting refused in one line where it cannot run. Scripted engines and pure Python: milliseconds."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from hpref.errors import RecipeError  # noqa: E402
from hpref.models.causal_lm import encode_prompt, policy_tokenizer  # noqa: E402
from hpref.plugins import load_plugins  # noqa: E402
from hpref.recipe.rl import parse_rl_section  # noqa: E402
from hpref.rl.control.preflight import check_cast  # noqa: E402
from hpref.rl.environments.signal import SignalConfig, named  # noqa: E402
from hpref.rl.rollout.episodes import Bounds, TurnCodec  # noqa: E402
from hpref.rl.rollout.joint import Seating, first_role, play_together  # noqa: E402
from hpref.rl.rollout_types import Generation  # noqa: E402
from tests.rl.tiny import TINY  # noqa: E402


def config(roles, policies=("a", "b"), **environment):
    return parse_rl_section(
        {
            "rollout": {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4},
            "environment": {"name": "signal", "roles": roles, **environment},
            "defaults": {"model": TINY},
            "policies": {p: {} for p in policies},
        },
        "r.toml",
    )


@pytest.fixture(scope="module")
def tokenizer():
    return policy_tokenizer(config({}).policies["a"].model)


def scripted_engines(tokenizer, answers):
    """`sample` for `play_together`: policy -> the text each of its rows answers (a function of the
    round and the row), tokenized; every call recorded."""
    calls = []
    eos = tokenizer.eos_token_id

    async def sample(policy, prompts, contexts, seed):
        calls.append((policy, [list(c) for c in contexts], seed))
        texts = [answers(policy, len(calls), j) for j in range(len(contexts))]
        completions = [tokenizer.encode(t, add_special_tokens=False) + [eos] for t in texts]
        return Generation(
            prompt_ids=[list(c) for c in contexts],
            completions=completions,
            logprobs=[[-0.5] * len(c) for c in completions],
            texts=texts,
            version=3 if policy == "a" else 5,
            tokens=sum(map(len, completions)),
            seconds=0.25,
        )

    return sample, calls


def seating(tokenizer, roles):
    codec = TurnCodec(lambda: tokenizer)
    bounds = Bounds("", max_turns=4, max_context_tokens=512, max_new_tokens=8)
    return Seating(roles, {p: codec for p in set(roles.values())}, {p: bounds for p in set(roles.values())})


def test_a_speaker_and_a_listener_play_one_episode_each_in_their_own_tokens(tokenizer):
    """`signal` with a speaker (a) and a listener (b): each round is one request per policy with every
    episode's acting role; the speaker's row is its opening (which names the target) and its message;
    the listener's is its own opening with the speaker's message in its one user message, and its
    answer; both get the environment's reward; the rows are grouped per start. Wrong: a policy that
    read the other's opening (the listener would see the target), turns sent one episode at a time,
    or the partner's tokens trained on."""
    env = load_plugins().get("environment", "signal").build(SignalConfig(names=["red", "blue"]))
    sample, calls = scripted_engines(tokenizer, lambda p, call, j: "go" if p == "a" else "red")
    seats = seating(tokenizer, {"speaker": "a", "listener": "b"})
    played = asyncio.run(play_together(env, seats, sample, [("p0",), ("p1",)], [{}, {}], 2, 11))
    assert [(c[0], len(c[1])) for c in calls] == [("a", 4), ("b", 4)]  # two rounds, 4 episodes each
    a, b = played["a"], played["b"]
    assert a.row_roles == ["speaker"] * 4 and b.row_roles == ["listener"] * 4
    eos = tokenizer.eos_token_id
    go = tokenizer.encode("go", add_special_tokens=False) + [eos]
    red = tokenizer.encode("red", add_special_tokens=False) + [eos]
    # the speaker's message joins the listener's question as one user message (no empty answer between)
    heard = encode_prompt(
        tokenizer, (f"{SignalConfig().listener_prompt.format(names='red, blue')}\n\nTheir message: go",)
    )
    for row in range(4):
        speaker_opening = a.prompt_ids[row]
        target = "red" if b.stats.success[row] else "blue"  # the listener always says red
        assert tokenizer.decode(speaker_opening, skip_special_tokens=True) == target
        assert a.completions[row] == go and a.masks[row] == [1] * len(go)
        listener_opening = b.prompt_ids[row]
        assert listener_opening == heard  # the same for every target: it never sees the target
        assert b.completions[row] == red and b.masks[row] == [1] * len(red)
    assert calls[1][1][0] == b.prompt_ids[0]  # what the listener's engine continued, exactly
    assert [t[-1] for t in b.transcripts] == [("listener", "red")] * 4
    # the listener always says red: right exactly where the target was red, one reward for both roles
    targets = [named(t[0][1], ["red", "blue"]) for t in a.transcripts]
    assert targets == [None] * 4  # the speaker's "go" names nothing: the success is the target's
    assert [r["listener"] for r in b.rewards] == [float(s) for s in b.stats.success]
    assert [r["speaker"] for r in a.rewards] == [r["listener"] for r in b.rewards]
    assert 0 < sum(b.stats.success) < 4  # both targets drawn over the four episodes' seeds
    assert a.version == 3 and b.version == 5  # each policy's own engine's version


def test_one_policy_in_both_roles_is_self_play_with_a_group_per_role(tokenizer):
    """Self-play: `a` seats both roles; its rows are, per start, the speaker's episodes then the
    listener's, so a GRPO group (consecutive `group` rows) is one role's answers to one start, never
    a mix of the two roles; the eval reads it in its first role. Wrong: a role compared with its
    partner in the advantages."""
    env = load_plugins().get("environment", "signal").build(SignalConfig(names=["red", "blue"]))
    sample, calls = scripted_engines(tokenizer, lambda p, call, j: "go" if call == 1 else "blue")
    seats = seating(tokenizer, {"speaker": "a", "listener": "a"})
    played = asyncio.run(play_together(env, seats, sample, [("p0",), ("p1",)], [{}, {}], 2, 5))
    assert list(played) == ["a"] and [c[0] for c in calls] == ["a", "a"]
    rows = played["a"]
    assert rows.row_roles == ["speaker", "speaker", "listener", "listener"] * 2
    # an eval plays one episode per prompt and reads each policy in its first role
    sample, calls = scripted_engines(tokenizer, lambda p, call, j: "go" if call == 1 else "blue")
    one = asyncio.run(play_together(env, seats, sample, [("p0",), ("p1",)], [{}, {}], 1, 5))["a"]
    assert one.row_roles == ["speaker", "listener"] * 2
    eval_rows = first_role(one, 2)
    assert eval_rows.texts == ["go", "go"] and eval_rows.row_roles == ["speaker", "speaker"]


@pytest.mark.parametrize(
    ("roles", "policies", "message"),
    [
        ({"speaker": "a"}, ("a", "b"), r"role\(s\) listener have no policy; name one for each"),
        ({"speaker": "a", "listener": "a"}, ("a", "b"), r"policy 'b' plays no role of the 'signal'"),
        (
            {"speaker": "a", "listner": "b"},
            ("a", "b"),
            r"roles.listner: the 'signal' environment has no role",
        ),
        ({"speaker": "a", "listener": "c"}, ("a", "b"), r"roles.listener: 'c' is not among the policies"),
    ],
)
def test_a_cast_that_cannot_play_is_one_line_before_any_actor_starts(roles, policies, message):
    """Every role played by a running policy and every running policy in a role; a typo'd role; a
    policy not run (an environment for two run with one). Wrong: an episode that waits forever for a
    role nobody plays, or a policy that trains on nothing."""
    with pytest.raises(RecipeError, match=message) as caught:
        check_cast(config(roles, policies), list(policies), "r.toml")
    assert str(caught.value).startswith("r.toml: rl.environment.roles")


def test_online_dpo_is_refused_where_policies_play_together():
    """Online DPO pairs a policy's answers to one prompt; in a shared episode there is no such pair."""
    cfg = config({"speaker": "a", "listener": "b"})
    cfg.policies["b"].algorithm.name = "online-dpo"
    with pytest.raises(RecipeError, match=r"rl.policies.b.algorithm: online-dpo judges a policy's answers"):
        check_cast(cfg, ["a", "b"], "r.toml")


def test_the_listener_names_what_it_mentions_first():
    """The choice rule the reward reads: first mention wins, case-insensitive, none is no choice."""
    assert named("Blue, not red", ["red", "blue"]) == 1
    assert named("RED", ["red", "blue"]) == 0
    assert named("green", ["red", "blue"]) is None
    with pytest.raises(ValueError, match="distinct"):
        SignalConfig(names=["Red", "red"])
