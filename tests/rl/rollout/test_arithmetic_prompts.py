"""The `arithmetic` prompt source (`[rl.prompts] name = "arithmetic"`, `hpref.builtin.prompts`): seeded
multi-digit problems with an exact `reference`, a held-out eval split no training draw reaches, and
its place in a recipe beside the `tool` environment's `matches_reference` rule. In process, ~1 s."""

from __future__ import annotations

import re
from collections import Counter
from fractions import Fraction

import pytest

from hpref.builtin.prompts import ArithmeticPrompts, ArithmeticPromptsConfig
from hpref.errors import DataError, RecipeError
from hpref.recipe.rl import parse_rl_section
from hpref.rl.environments.calculator import calculate
from hpref.rl.environments.tool import matches_reference

QUESTION = re.compile(r"^What is (\d+) ([-+*/]) (\d+)\?$", re.MULTILINE)


def source(**keys) -> ArithmeticPrompts:
    return ArithmeticPrompts(ArithmeticPromptsConfig(**keys))


def test_problems_are_seeded_by_position_and_their_references_are_exact():
    """Wrong if prompt i moved with the rollout size or a resume (`train_prompts(seed, first, count)`
    must depend only on (seed, i)), if the seed changed nothing, if an operand left 3-5 digits, if an
    operation was never drawn, or if a reference was not the exact value (a division with a remainder,
    a rounded product): the reward would then train on wrong answers."""
    arithmetic = source()
    first = arithmetic.train_prompts(0, 0, 400)
    assert arithmetic.train_prompts(0, 37, 5) == first[37:42]
    assert source().train_prompts(0, 0, 400) == first  # a fresh source: the same stream
    assert len(set(first) & set(arithmetic.train_prompts(1, 0, 400))) < 5
    operations = Counter()
    for prompt in first:
        (text,) = prompt
        assert "<calculator>" in text and "</calculator>" in text  # the prompt says how to call it
        a, op, b = QUESTION.search(text).groups()
        operations[op] += 1
        reference = arithmetic.row(prompt)["reference"]
        assert Fraction(reference) == calculate(f"{a} {op} {b}")
        assert isinstance(reference, int)  # `/` is exact: no quotient has a remainder
        # the operands (for `/`, the divisor and the quotient) have 3 to 5 digits
        shown = (reference, b) if op == "/" else (a, b)
        assert all(3 <= len(str(n)) <= 5 for n in shown), text
        assert matches_reference(prompt, f"The answer is {reference:,}.", arithmetic.row(prompt)) == 1.0
        assert matches_reference(prompt, f"The answer is {reference + 1}.", arithmetic.row(prompt)) == 0.0
    assert set(operations) == {"+", "-", "*", "/"} and min(operations.values()) > 60
    assert arithmetic.row(("What is the capital of France?",)) == {}


def test_eval_problems_are_held_out_fixed_and_never_trained_on():
    """Wrong if an eval problem could also be drawn for training (the eval would measure memory, not
    tool use), if the eval set moved with the run seed (start and end, or two runs, would be scored
    on different problems), or if it held a problem twice."""
    arithmetic = source(eval_fraction=0.1)
    evals = arithmetic.eval_prompts(0, 64)
    assert len(set(evals)) == 64 and all(arithmetic.held_out(p) for p in evals)
    assert (
        arithmetic.eval_prompts(7, 64) == evals and source(eval_fraction=0.1).eval_prompts(0, 8) == evals[:8]
    )
    trained = {p for seed in (0, 1) for p in arithmetic.train_prompts(seed, 0, 3000)}
    assert not trained & set(evals) and not any(arithmetic.held_out(p) for p in trained)
    assert not set(source(eval_fraction=0.1, split_seed=1).eval_prompts(0, 64)) & set(evals)


def test_a_recipe_names_it_and_bad_settings_are_one_line():
    """Wrong if `[rl.prompts] name = "arithmetic"` were not a registered source, its parameters were
    not checked when the recipe loads, or a split too small for the evals asked looped forever
    instead of saying what to change."""
    config = parse_rl_section(
        {
            "policies": {"a": {}},
            "prompts": {"name": "arithmetic", "operations": ["*"], "min_digits": 2, "max_digits": 2},
            "environment": {"name": "tool"},
            "reward": {
                "name": "rule",
                "function": "hpref.rl.environments.tool:matches_reference",
                "columns": ["reference"],
            },
        },
        "recipe.toml",
    )
    from hpref.rl.control.preflight import check_rewards_fit_prompts
    from hpref.rl.rollout.prompts import build_prompt_source

    built = build_prompt_source(config)
    check_rewards_fit_prompts(config, built, "recipe.toml")  # the reward's `reference` column is there
    (prompt,) = built.train_prompts(0, 0, 1)
    assert re.search(r"What is \d\d \* \d\d\?", prompt[0])
    with pytest.raises(
        RecipeError, match=r"recipe.toml: rl.prompts: min_digits = 4 is more than max_digits = 3"
    ):
        parse_rl_section(
            {"policies": {"a": {}}, "prompts": {"name": "arithmetic", "min_digits": 4, "max_digits": 3}},
            "recipe.toml",
        )
    with pytest.raises(RecipeError, match=r"rl.prompts.*operations"):
        parse_rl_section(
            {"policies": {"a": {}}, "prompts": {"name": "arithmetic", "operations": ["^"]}}, "recipe.toml"
        )
    # 81 one-digit sums, about 4 of them held out: 20 distinct eval problems do not exist
    tiny = source(operations=["+"], min_digits=1, max_digits=1)
    with pytest.raises(
        DataError, match=r"arithmetic\(\+, 1-1 digits\): \d distinct held-out problems in \d+ draws, 20 asked"
    ):
        tiny.eval_prompts(0, 20)
