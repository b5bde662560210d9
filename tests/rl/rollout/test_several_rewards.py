"""Several rewards (`[rl.rewards.<name>]`, weighted) and labelled rewards (a `rule` function that reads
the prompt file's row): the recipe, the weighted sum, the per-component metrics, the refusals. No
Ray: the reward set, the prompt source and the checks are called as the executor and launcher do."""

from __future__ import annotations

import json

import pytest

from hpref.errors import RecipeError
from hpref.recipe.rl import parse_rl_section
from hpref.recipe.rl_rewards import reward_parts
from hpref.rl.report.metrics import eval_line, eval_row, length_percentiles, rollout_metrics
from hpref.rl.rollout.rewards import RewardSet
from hpref.rl.rollout_types import rollout_of_tokens

LABELLED = "tests.rl.labelled:matches_reference"
LENGTH = "tests.rl.labelled:length"


def section(**over):
    data = {"policies": {"a": {}}, "prompts": {"name": "synthetic"}}
    data.update(over)
    return data


def two_rewards(weight=0.5):
    return {
        "exact": {"name": "rule", "function": LABELLED, "columns": ["reference"]},
        "length": {"name": "rule", "function": LENGTH, "weight": weight},
    }


def test_several_rewards_are_parsed_with_their_weights_and_keys():
    # Wrong if the weights were not read, the order changed, or a component's own parameters
    # (columns) were lost to the weight.
    config = parse_rl_section(section(rewards=two_rewards(0.25)), "r.toml")
    parts = reward_parts(config)
    assert [(p.name, p.key, p.weight) for p in parts] == [
        ("exact", "rl.rewards.exact", 1.0),
        ("length", "rl.rewards.length", 0.25),
    ]
    assert parts[0].config.columns == ["reference"]
    # [rl.reward] alone stays one unnamed part (its metrics keep their names)
    (alone,) = reward_parts(parse_rl_section(section(reward={"name": "rule"}), "r.toml"))
    assert (alone.name, alone.key, alone.weight) == ("reward", "rl.reward", 1.0)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {"reward": {"name": "rule"}, "rewards": two_rewards()},
            r"rl\.rewards: the recipe has both \[rl\.reward\]",
        ),
        (
            {"rewards": {"x": {"name": "rule", "weight": 0}, "y": {"name": "rule", "weight": -1}}},
            r"every weight is zero or negative \(x = 0, y = -1\)",
        ),
        ({"rewards": {"Bad-Name": {"name": "rule"}}}, r"rl\.rewards\.Bad-Name: a reward's name"),
        (
            {"rewards": {"fast_start": {"name": "rule"}}},
            r"rl\.rewards\.fast_start: a reward's name may not end",
        ),
        (
            {"rewards": {"x": {"name": "rule", "weight": "high"}}},
            r"rl\.rewards\.x\.weight: expected a number",
        ),
        ({"rewards": {"x": {"name": "rulez"}}}, r"rl\.rewards\.x.*did you mean 'rule'"),
        ({"rewards": {"x": {"name": "rule", "colums": []}}}, r"rl\.rewards\.x\.colums"),
    ],
)
def test_bad_reward_sections_are_one_line_naming_the_key(data, match):
    # Wrong if a recipe with both sections, nothing to maximise, or a misspelt key ran anyway or
    # failed with a traceback instead of one line naming the key.
    with pytest.raises(RecipeError, match=match) as caught:
        parse_rl_section(section(**data), "r.toml")
    assert "\n" not in str(caught.value)


def test_the_reward_is_the_weighted_sum_and_each_component_is_kept():
    # Wrong if the sum used other weights, the components were not scored on their own, the row
    # did not reach the labelled function, or scoring in parallel mixed up components.
    config = parse_rl_section(section(rewards=two_rewards(0.5)), "r.toml")
    rewards = RewardSet.from_parts(reward_parts(config))
    assert rewards.named and rewards.wants_rows and rewards.names == ["exact", "length"]
    prompts = [("What is 12 + 30?",), ("What is 2 + 2?",)]
    groups = [["It is 42.", "41"], ["4", "It is 5"]]
    rows = [{"reference": "42"}, {"reference": 4}]
    total, parts = rewards.score_components(prompts, groups, None, rows)
    assert parts["exact"] == [[1.0, 0.0], [1.0, 0.0]]
    assert parts["length"] == [[9.0, 2.0], [1.0, 7.0]]
    assert total == [[1.0 + 4.5, 1.0], [1.0 + 0.5, 3.5]]
    assert rewards.score_groups(prompts, groups, None, rows) == total


def test_a_prompt_file_carries_its_other_columns_to_the_reward(tmp_path):
    # Wrong if the prompt source dropped the row's columns (a verifiable reward could not be written),
    # kept the conversation's text as a column, or mixed up which row a prompt came from.
    from hpref.builtin.prompts import FilePromptsConfig, build_file

    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"What is {i} + {i}?", "reference": 2 * i, "id": f"q{i}"} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = build_file(FilePromptsConfig(path=str(path), eval_fraction=0.1))
    assert source.columns == ("id", "reference")
    for prompt in source.train_prompts(0, 0, 10) + source.eval_prompts(0, 3):
        i = int(prompt[-1].split()[2])
        assert source.row(prompt) == {"reference": 2 * i, "id": f"q{i}"}


def test_a_pair_file_carries_its_extra_columns_but_not_the_conversation(tmp_path):
    # Wrong if a chosen/rejected file's prompts lost their row's label, or the answers' text or the
    # reader's own bookkeeping (its row number) showed up as columns a reward could read.
    from hpref.builtin.prompts import PairwisePromptsConfig, build_pairwise

    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"Say {i}.", "chosen": f"{i}", "rejected": "no", "label": i % 3, "source": "unit"}
        for i in range(30)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = build_pairwise(PairwisePromptsConfig(path=str(path), eval_fraction=0.0))
    assert source.columns == ("label", "source")
    (prompt,) = source.train_prompts(0, 0, 1)
    assert source.row(prompt) == {"label": int(prompt[-1].split()[1].rstrip(".")) % 3, "source": "unit"}


def test_rewards_that_cannot_score_the_prompts_are_refused_before_the_run(tmp_path):
    # Wrong if a reward asking for a column the prompt file lacks, or a function whose signature
    # does not fit, got as far as an actor (where it fails on the first rollout, not in one line).
    from hpref.builtin.prompts import FilePromptsConfig, build_file
    from hpref.rl.control.preflight import check_rewards_fit_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}?", "reference": i}) + "\n" for i in range(20)))
    prompts = build_file(FilePromptsConfig(path=str(path), eval_fraction=0.0))
    ok = parse_rl_section(section(rewards=two_rewards()), "r.toml")
    check_rewards_fit_prompts(ok, prompts, "r.toml")
    rule = {"name": "rule", "function": LABELLED}
    cases = [
        ({**rule, "columns": ["answer"]}, r"rl\.rewards\.x\.columns: 'answer' not in"),
        (
            {**rule, "function": "tests.rl.labelled:too_many"},
            r"rl\.rewards\.x\.function: .* takes \(prompt, answer, row, extra\)",
        ),
        ({**rule, "function": LENGTH, "columns": ["reference"]}, r"rl\.rewards\.x\.columns: the function"),
        ({"name": "rule"}, r"rl\.rewards\.x\.name: 'rule' scores with the synthetic arena's judge"),
    ]
    for reward, match in cases:
        config = parse_rl_section(section(rewards={"x": reward}), "r.toml")
        with pytest.raises(RecipeError, match=match):
            check_rewards_fit_prompts(config, prompts, "r.toml")


def test_online_dpo_needs_every_reward_to_judge_pairs_with_no_negative_weight():
    # Wrong if a pair verdict could be a weighted mean with a negative weight (not a distribution).
    from hpref.rl.algorithms.registry import check_algorithms

    rewards = {"x": {"name": "rule"}, "y": {"name": "rule", "mode": "pairwise", "weight": -0.5}}
    config = parse_rl_section(
        section(rewards=rewards, policies={"a": {"algorithm": "online-dpo"}}, rollout={"group_size": 2}), "r"
    )
    with pytest.raises(RecipeError, match=r"rl\.rewards\.y\.weight is -0\.5; use weights >= 0"):
        check_algorithms(config, ["a"], "r")


def test_pair_verdicts_are_the_weighted_mean_of_the_components():
    # Wrong if a verdict of several rewards were not a probability distribution or ignored a weight.
    from hpref import arena as synthetic
    from hpref.builtin.rewards import RuleConfig, build_rule

    utility, labelled = build_rule(RuleConfig()), build_rule(RuleConfig(function=LENGTH))
    from hpref.rl.rollout.rewards import Component

    rewards = RewardSet(
        [Component("u", utility, 3.0), Component("len", labelled, 1.0), Component("z", utility, 0.0)], True
    )
    prompt = ("What is 12 + 30?",)
    (verdict,) = rewards.judge_answers([prompt], [("42", "41!")])
    first = synthetic.davidson(
        synthetic.answer_utility(prompt, "42"), synthetic.answer_utility(prompt, "41!")
    )
    second = synthetic.davidson(2.0, 3.0)
    assert verdict == pytest.approx(tuple(0.75 * a + 0.25 * b for a, b in zip(first, second, strict=True)))
    assert sum(verdict) == pytest.approx(1.0)


def test_rollout_and_eval_rows_carry_each_component_and_length_percentiles():
    # Wrong if a component's mean, the answer-length percentiles, or an eval's per-component means
    # were missing from metrics.jsonl, or the log line lost them.
    rollout = rollout_of_tokens(
        0, [[1]] * 4, [[5] * n for n in (1, 2, 3, 10)], [[0.0] * n for n in (1, 2, 3, 10)],
        [1.0, 2.0, 3.0, 4.0], 2, reward_components={"exact": [1.0, 0.0, 1.0, 1.0], "length": [1, 2, 3, 4]},
    )  # fmt: skip
    row = rollout_metrics(rollout, {}, 0)
    assert row["reward_exact_mean"] == 0.75 and row["reward_length_mean"] == 2.5
    assert (row["answer_tokens_p50"], row["answer_tokens_max"]) == (2.5, 10.0)
    assert row["answer_tokens_p10"] == pytest.approx(1.3) and row["answer_tokens_p90"] == pytest.approx(7.9)
    assert length_percentiles([7])["answer_tokens_p90"] == 7.0
    evaluation = {
        "reward": {"means": {"a": 1.5, "a@start": 0.5}, "win_rate_vs_start": {"a": 0.7}},
        "reward_components": {"exact": {"a": 0.5, "a@start": 0.25}, "length": {"a": 2.0, "a@start": 0.5}},
    }
    ev = eval_row(evaluation, "a")
    assert (ev["eval_reward_exact"], ev["eval_reward_exact_start"], ev["eval_reward_length"]) == (
        0.5,
        0.25,
        2.0,
    )
    assert ev["eval_reward"] == 1.5 and ev["eval_reward_win_rate_vs_start"] == 0.7
    assert "(exact 0.500, length 2.000)" in eval_line(evaluation, "a")
