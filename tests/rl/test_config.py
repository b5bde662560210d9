"""The [rl] recipe section: defaults, per-policy merging, the override whitelist, one-line errors."""

from __future__ import annotations

import pytest

from hpref.errors import RecipeError, UserError
from hpref.recipe.rl import POLICY_ROLLOUT_OVERRIDES, RLConfig, parse_rl_section


def section(**over):
    data = {
        "num_rollouts": 6,
        "defaults": {"lr": 3e-4, "model": {"hidden_size": 32}},
        "policies": {"a": {}, "b": {"kl_coef": 0.1, "model": {"seed": 7}, "rollout": {"temperature": 0.5}}},
    }
    data.update(over)
    return data


def test_policies_merge_over_defaults_key_by_key():
    cfg = parse_rl_section(section(), "r.toml")
    assert isinstance(cfg, RLConfig)
    a, b = cfg.policies["a"], cfg.policies["b"]
    assert a.lr == b.lr == 3e-4
    # b changed one model key; the defaults' other model key must survive the merge
    assert (b.model.hidden_size, b.model.seed) == (32, 7)
    assert (a.model.hidden_size, a.model.seed) == (32, 0)
    assert (a.kl_coef, b.kl_coef) == (0.0, 0.1)


def test_policy_rollout_overrides_apply_to_that_policy_only():
    cfg = parse_rl_section(section(), "r.toml")
    assert cfg.policy_rollout("b").temperature == 0.5
    assert cfg.policy_rollout("a").temperature == 1.0
    assert cfg.policy_rollout("b").group_size == cfg.rollout.group_size


def test_reward_is_resolved_against_the_registry():
    cfg = parse_rl_section(section(reward={"name": "rule", "mode": "pairwise"}), "r.toml")
    assert cfg.reward_config.mode == "pairwise"


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"policies": {"a": {"lrr": 1}}}, "r.toml: rl.policies.a.lrr: unknown key (did you mean 'lr'?)"),
        (
            {"policies": {"a": {"rollout": {"group_size": 2}}}},
            "rl.policies.a.rollout.group_size: unknown key; valid keys: temperature, top_k, max_new_tokens",
        ),
        ({"policies": {"a": {"lr": -1}}}, "r.toml: rl.policies.a.lr: Input should be greater than 0, got -1"),
        ({"policies": {"A b": {}}}, "r.toml: rl.policies.A b: a policy id is 1-32 lowercase"),
        ({"policies": {}}, "r.toml: rl.policies: declare at least one policy"),
        ({"defaults": {"clip": 0.2}}, "r.toml: rl.defaults.clip: unknown key (did you mean 'clip_low'?)"),
        ({"save_intervall": 2}, "r.toml: rl.save_intervall: unknown key (did you mean 'save_interval'?)"),
        (
            {"rollout": {"group_size": 1}},
            "r.toml: rl.rollout.group_size: Input should be greater than or equal to 2",
        ),
        (
            {"reward": {"name": "rulee"}},
            "r.toml: rl.reward.name: unknown reward 'rulee' (did you mean 'rule'?)",
        ),
        (
            {"reward": {"name": "rule", "mood": "x"}},
            "r.toml: rl.reward.mood: unknown key (did you mean 'mode'?)",
        ),
        ({"debug_exit_after_rollout": 9}, "debug_exit_after_rollout (9) is after the last rollout (6)"),
    ],
)
def test_errors_are_one_line_and_name_the_dotted_key(over, message):
    with pytest.raises(RecipeError) as info:
        parse_rl_section(section(**over), "r.toml")
    text = str(info.value)
    assert "\n" not in text
    assert message in text, text


def test_missing_section_is_an_error():
    with pytest.raises(RecipeError, match="needs an \\[rl\\] section"):
        parse_rl_section(None, "r.toml")


def test_select_checks_policy_ids_leader_first():
    cfg = parse_rl_section(section(), "r.toml")
    assert cfg.select(["b", "a"]) == ["b", "a"]
    with pytest.raises(UserError, match="no policy 'c'"):
        cfg.select(["a", "c"])
    with pytest.raises(UserError, match="names 'a' twice"):
        cfg.select(["a", "a"])
    with pytest.raises(UserError, match="at least one"):
        cfg.select([])


def test_whitelist_is_exactly_the_override_model():
    from hpref.recipe.rl import PolicyRolloutOverrides

    assert tuple(PolicyRolloutOverrides.model_fields) == POLICY_ROLLOUT_OVERRIDES


def test_the_recipe_types_its_rl_section_once_with_the_lora_default():
    """`Recipe.rl` is the validated `RLConfig` (reward and engine resolved), parsed once when the
    recipe loads, with the recipe's `[lora]` as every policy's default; its errors are the [rl]
    parser's one-line messages; the resolved recipe it writes reloads to the same section."""
    import tomllib

    from hpref.recipe import recipe_from_dict

    recipe = recipe_from_dict({"rl": section(), "lora": {"r": 3}})
    assert isinstance(recipe.rl, RLConfig)
    assert recipe.rl.policies["a"].lora is not None and recipe.rl.policies["a"].lora.r == 3
    assert recipe.rl.reward_config is not None and recipe.rl.engine_config is not None
    unknown = r"^recipe: rl\.policies\.a\.lrr: unknown key \(did you mean 'lr'\?\)"
    with pytest.raises(RecipeError, match=unknown):
        recipe_from_dict({"rl": {"policies": {"a": {"lrr": 1}}}})
    with pytest.raises(RecipeError, match=r"^recipe: rl: expected a table"):
        recipe_from_dict({"rl": 3})
    again = recipe_from_dict(tomllib.loads(recipe.to_toml()))
    assert again.rl.model_dump() == recipe.rl.model_dump()
    assert again.to_toml() == recipe.to_toml()
