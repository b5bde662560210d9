"""`hpref rl --plan` with an environment's episodes (issue #49): an episode's trainer row and the
transformers engine's KV cache grow to `[rl.environment] max_context_tokens`, so the estimate counts
that bound where a single turn counts prompt + max_new_tokens, and the plan says so. With policies
that play together (#50, `[rl.environment] roles`) it places each role and counts a self-play
policy's rows and a shared engine's episodes as the run makes them. In process, a few seconds (the
CLI's plan of a tiny recipe)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from hpref import cli
from hpref.recipe.rl import parse_rl_section
from hpref.rl.placement.nodes import Node
from hpref.rl.plan.memory import GIB, MICRO_BATCH_SLACK, micro_batch_activations, model_shape, seated
from hpref.rl.plan.table import plan_rows, roles_line
from tests.rl.tiny import TINY, write_rl_recipe

PROMPT = 20
ROLLOUT = {"group_size": 2, "prompts_per_rollout": 2, "max_new_tokens": 4}


def _config(environment: dict | None):
    section = {"policies": {"a": {"model": TINY, "precision": "fp32"}}, "rollout": ROLLOUT}
    if environment is not None:
        section["environment"] = environment
    return parse_rl_section(section, "recipe.toml")


def _terms(environment: dict | None) -> dict[str, dict[str, int]]:
    config = _config(environment)
    rows = plan_rows(config, ["a"], [Node("node", 4, 0, 64 * GIB)], {"a": PROMPT}, baseline=GIB // 2)
    return {r.actor: r.memory.terms for r in rows}


def test_an_episodes_estimate_grows_with_its_context_bound_and_a_single_turn_is_unchanged():
    """Wrong if the plan of a multi-turn run counted rows of prompt + max_new_tokens (it would say
    "fits" for episodes that grow to max_context_tokens and run out of memory), if the bound did not
    move the trainer's micro-batch and the engine's KV cache, or if single-turn runs' estimates moved
    (their rows are still a prompt and one answer, whatever max_context_tokens says)."""
    single = _terms(None)
    assert _terms({"name": "single-turn", "max_context_tokens": 1024}) == single
    short, long = (_terms({"name": "tool", "max_context_tokens": n}) for n in (256, 1024))
    policy = _config(None).policies["a"]
    shape = model_shape(policy)
    for terms, context in ((single, PROMPT + 4), (short, 256), (long, 1024)):
        # the micro-batch: as many of the 2 prompt groups as micro_batch_tokens holds, each prompt
        # once and its 2 rows `context - prompt` tokens after it
        after = context - PROMPT
        groups = max(1, min(2, policy.micro_batch_tokens // (PROMPT + 2 * after)))
        step = micro_batch_activations(shape, PROMPT, after, groups, 2, bf16=False)
        assert terms["a trainer 0"]["micro-batch"] == int(step * MICRO_BATCH_SLACK)
        # the engine's 4 rows: each a KV cache of `context` positions (keys and values of every block,
        # fp32, old and new alive while `generate` concatenates) and a step's [rows, vocab] tensors;
        # an episode's later turn forwards every row's context (one answer short) to its logits; a
        # single turn forwards the 2 prompts; or a sync's bucket (the default 256 MiB holds the whole
        # tiny model): the largest of the three
        kv = 4 * context * shape.layers * 2 * shape.kv_width * 4 * 2
        forwarded = 4 * (context - 4) if terms is not single else 2 * PROMPT
        transients = {
            "generation": kv + 4 * 4 * shape.vocab * 4,
            "prompt logits": forwarded * shape.vocab * 4,
            "sync bucket": shape.params * 4,
        }
        largest = max(transients, key=transients.__getitem__)
        assert {k: v for k, v in terms["a engine"].items() if k in transients} == {
            largest: transients[largest]
        }
    assert sum(single["a engine"].values()) < sum(short["a engine"].values()) < sum(long["a engine"].values())


def _invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args), catch_exceptions=False)


def test_the_plan_says_it_counted_the_context_bound(tmp_path: Path):
    """Wrong if a reader of a multi-turn plan could not tell which length its memory column assumed,
    or a single-turn plan claimed the episode bound."""
    recipe = write_rl_recipe(tmp_path, "episodes")
    plain = _invoke("rl", str(recipe), "--policies", "a", "--plan")
    assert plain.exit_code == 0, plain.output
    assert "episodes (" not in plain.output
    tool = _invoke(
        "rl",
        str(recipe),
        "--policies",
        "a",
        "--plan",
        "--set",
        'rl.environment={ name = "tool", max_context_tokens = 300 }',
    )
    assert tool.exit_code == 0, tool.output
    assert tool.output.splitlines()[1] == (
        "episodes ('tool' environment): trainer rows and engine KV caches counted up to "
        "max_context_tokens = 300 tokens, not prompt + max_new_tokens"
    )


def _seated_config(roles: dict[str, str], policies=("a", "b"), **rl):
    section = {
        "policies": {p: {"model": TINY, "precision": "fp32"} for p in policies},
        "rollout": ROLLOUT,
        "environment": {"name": "signal", "max_context_tokens": 256, "roles": roles},
        **rl,
    }
    return parse_rl_section(section, "recipe.toml")


def _plan(config, order):
    nodes = [Node("node", 4, 0, 64 * GIB)]
    rows = plan_rows(config, order, nodes, {p: PROMPT for p in order}, baseline=GIB // 2)
    return rows, roles_line(config, seated(config, order), rows)


def test_the_plan_says_which_policy_plays_each_role_and_counts_a_self_play_policys_rows():
    """Policies that play together (`[rl.environment] roles`): the plan names, per role, the policy and
    the actors that play it; a policy in two roles (self-play) trains a row per role of each episode,
    so its trainer's micro-batch holds twice the prompt groups; a shared base's engine is asked for
    one row per episode each round (one acting role per episode), not one per policy it serves.
    Wrong if a reader could not tell which engine and trainer play a role, or the estimate counted
    a self-play trainer's rows once (too small) or a shared engine's episodes twice (too large)."""
    two, line = _plan(_seated_config({"speaker": "a", "listener": "b"}), ["a", "b"])
    assert line == (
        "roles ('signal' environment, played together): speaker by a (a engine, a trainer 0), "
        "listener by b (b engine, b trainer 0)"
    )
    alone, line = _plan(_seated_config({"speaker": "a", "listener": "a"}, policies=("a",)), ["a"])
    assert line == (
        "roles ('signal' environment, played together): speaker by a (a engine, a trainer 0), "
        "listener by a (a engine, a trainer 0); a trains a row per role of each episode (2)"
    )
    policy = _seated_config({}).policies["a"]
    shape, after = model_shape(policy), 256 - PROMPT
    per_group = PROMPT + 2 * after  # a prompt and its 2 rows of up to max_context_tokens
    for rows, groups in ((two, 2), (alone, 4)):  # 2 prompts x the roles a plays
        fit = max(1, min(groups, policy.micro_batch_tokens // per_group))
        step = micro_batch_activations(shape, PROMPT, after, fit, 2, bf16=False)
        trainer = next(r for r in rows if r.actor == "a trainer 0")
        assert trainer.memory.terms["micro-batch"] == int(step * MICRO_BATCH_SLACK)
    assert policy.micro_batch_tokens // per_group >= 4  # the self-play rows do change the estimate

    lora = {"defaults": {"lora": {"r": 4}}, "share_base": True}
    shared, line = _plan(_seated_config({"speaker": "a", "listener": "b"}, **lora), ["a", "b"])
    assert line == (
        "roles ('signal' environment, played together): speaker by a (a engine (shared by a, b), "
        "a trainer 0 (shared by a, b)), listener by b (a engine (shared by a, b), a trainer 0 "
        "(shared by a, b))"
    )
    apart = parse_rl_section(
        {
            "policies": {p: {"model": TINY, "precision": "fp32"} for p in ("a", "b")},
            "rollout": ROLLOUT,
            "environment": {"name": "tool", "max_context_tokens": 256},
            **lora,
        },
        "recipe.toml",
    )
    own_episodes = plan_rows(
        apart, ["a", "b"], [Node("node", 4, 0, 64 * GIB)], {"a": PROMPT, "b": PROMPT}, baseline=GIB // 2
    )
    engine = next(r for r in shared if r.actor.startswith("a engine")).memory.terms
    separate = next(r for r in own_episodes if r.actor.startswith("a engine")).memory.terms
    # the engine's largest transient is the rows' later-turn prefill: 4 episodes' contexts together,
    # 8 when each policy plays its own 4
    forwarded = 4 * (256 - 4) * shape.vocab * 4
    assert engine["prompt logits"] == forwarded and separate["prompt logits"] == 2 * forwarded


def test_the_plan_prints_the_roles_and_refuses_a_cast_that_cannot_play(tmp_path: Path):
    """`hpref rl --plan` of policies that play together prints the roles line under the header; a
    role with no policy is the run's own one-line refusal naming `rl.environment.roles` (exit 2 from
    the CLI), before any estimate. Wrong if the plan hid who plays what, or said "fits" for a cast
    `hpref rl` would refuse."""
    from hpref.errors import RecipeError

    recipe = write_rl_recipe(tmp_path, "roles")
    cast = 'rl.environment={ name = "signal", roles = { speaker = "b", listener = "a" } }'
    plan = _invoke("rl", str(recipe), "--policies", "a,b", "--plan", "--set", cast)
    assert plan.exit_code == 0, plan.output
    assert (
        "roles ('signal' environment, played together): speaker by b (b engine in the rollout executor, "
        "b trainer 0), listener by a (a engine in the rollout executor, a trainer 0)"
    ) in plan.output.splitlines()[:5]
    lonely = 'rl.environment={ name = "signal", roles = { speaker = "a" } }'
    with pytest.raises(
        RecipeError, match=r"rl\.environment\.roles: the 'signal' environment's role\(s\) listener"
    ):
        _invoke("rl", str(recipe), "--policies", "a,b", "--plan", "--set", lonely)
