"""`hpref rl --plan` with an environment's episodes (issue #49): an episode's trainer row and the
transformers engine's KV cache grow to `[rl.environment] max_context_tokens`, so the estimate counts
that bound where a single turn counts prompt + max_new_tokens, and the plan says so. In process, a
few seconds (the CLI's plan of a tiny recipe)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from hpref import cli
from hpref.recipe.rl import parse_rl_section
from hpref.rl.placement.nodes import Node
from hpref.rl.plan.memory import GIB, MICRO_BATCH_SLACK, micro_batch_activations, model_shape
from hpref.rl.plan.table import plan_rows
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
        # single turn forwards the 2 prompts; or a sync's staged weights: the largest of the three
        kv = 4 * context * shape.layers * 2 * shape.kv_width * 4 * 2
        forwarded = 4 * (context - 4) if terms is not single else 2 * PROMPT
        transients = {
            "generation": kv + 4 * 4 * shape.vocab * 4,
            "prompt logits": forwarded * shape.vocab * 4,
            "staged sync": shape.params * 4,
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
