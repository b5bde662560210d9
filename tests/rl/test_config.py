"""The [rl] recipe section: defaults, per-policy merging, the override whitelist, one-line errors."""

from __future__ import annotations

import pytest

from hpref.errors import RecipeError, UserError
from hpref.recipe.loading import apply_overrides
from hpref.recipe.rl import POLICY_ROLLOUT_OVERRIDES, RLConfig, parse_rl_section
from hpref.recipe.rl_components import resolve_algorithm


def section(**over):
    data = {
        "num_rollouts": 6,
        "defaults": {"lr": 3e-4, "model": {"hidden_size": 32}},
        "policies": {
            "a": {},
            "b": {"algorithm": {"kl_coef": 0.1}, "model": {"seed": 7}, "rollout": {"temperature": 0.5}},
        },
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
    assert (resolve_algorithm(a.algorithm, "a").kl_coef, resolve_algorithm(b.algorithm, "b").kl_coef) == (
        0.0,
        0.1,
    )


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
        (
            {"defaults": {"grad_clp": 1}},
            "r.toml: rl.defaults.grad_clp: unknown key (did you mean 'grad_clip'?)",
        ),
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


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"policies": {"a": {}, "b": {"kl_coef": 0.05}}},
            "r.toml: rl.policies.b.kl_coef moved into the grpo algorithm's settings: "
            'algorithm = { name = "grpo", kl_coef = 0.05 }',
        ),
        (
            {"defaults": {"advantage": "rloo"}},
            "r.toml: rl.defaults.advantage moved into the grpo algorithm's settings: "
            'algorithm = { name = "grpo", advantage = "rloo" }',
        ),
        (  # beside a table that is already right: the old key still says where it went
            {"policies": {"a": {"algorithm": {"name": "grpo"}, "measure_kl": True}}},
            "r.toml: rl.policies.a.measure_kl moved into the grpo algorithm's settings: "
            'algorithm = { name = "grpo", measure_kl = true }',
        ),
    ],
)
def test_grpo_keys_at_the_policy_level_are_refused_saying_where_they_went(over, message):
    """GRPO's seven settings live in its algorithm table; one at a policy's or [rl.defaults]' own
    level is refused in exactly this line, its value written back as the TOML to use. Wrong if an old
    recipe's key were dropped silently (a run without its KL term) or refused as a bare unknown key."""
    with pytest.raises(RecipeError) as info:
        parse_rl_section(section(**over), "r.toml")
    assert str(info.value) == message


def test_grpo_settings_merge_over_the_defaults_algorithm_and_set_reaches_them():
    """`[rl.defaults] algorithm = { name = "grpo", ... }` is every policy's, a policy's own table
    changes one key of it, a plain name replaces it, and `--set rl.policies.<id>.algorithm.<key>`
    adds a key to the table. Wrong if a policy lost the defaults' kl_coef, online DPO were handed
    GRPO's keys, or the --set key path did not reach the algorithm."""
    data = section(
        defaults={"algorithm": {"name": "grpo", "kl_coef": 0.04, "measure_kl": True}},
        policies={"a": {}, "b": {"algorithm": {"advantage": "rloo"}}, "c": {"algorithm": "online-dpo"}},
    )
    data = apply_overrides({"rl": data}, ["rl.policies.a.algorithm.clip_high=0.3"])["rl"]
    cfg = parse_rl_section(data, "r.toml")
    a, b = (resolve_algorithm(cfg.policies[p].algorithm, p) for p in ("a", "b"))
    assert (a.kl_coef, a.measure_kl, a.advantage, a.clip_high) == (0.04, True, "grpo", 0.3)
    assert (b.kl_coef, b.measure_kl, b.advantage, b.clip_high) == (0.04, True, "rloo", 0.28)
    assert cfg.policies["c"].algorithm.name == "online-dpo" and cfg.policies["c"].algorithm.params() == {}


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
