"""The online-DPO benchmark's plumbing (benchmarks/online_dpo_trl.py, rl_real.py's `-dpo` contenders),
without training anything: hpref must run the algorithm TRL runs, and the table must compare them."""

from __future__ import annotations

from benchmarks import online_dpo_trl
from benchmarks.rl_real import HPREF_CONTENDERS, RECIPE, TRL_CONTENDERS, recipe_defaults


def test_hpref_dpo_contender_runs_standard_dpo_in_pairs_on_the_shipped_recipe():
    """Wrong if a mistyped `--set` left the policy on GRPO (or the tie-aware default loss), or sampled
    other than 2 answers to P prompts: the timings would compare another algorithm or batch than
    TRL's OnlineDPOTrainer (sigmoid, beta 0.1, 2 answers, the recipe's learning rate)."""
    from hpref.recipe import load_recipe
    from hpref.recipe.rl_components import resolve_algorithm

    recipe = load_recipe(RECIPE, online_dpo_trl.hpref_overrides(5)[1::2])
    assert online_dpo_trl.hpref_overrides(5)[0::2] == ["--set"] * 3
    assert recipe.rl.rollout.group_size == 2 and recipe.rl.rollout.prompts_per_rollout == 5
    for name, policy in recipe.rl.policies.items():
        algorithm = resolve_algorithm(policy.algorithm, name)
        assert policy.algorithm.name == "online-dpo"
        assert (algorithm.loss_type, algorithm.beta) == ("sigmoid", online_dpo_trl.BETA)
        assert algorithm.pairs == "own" and algorithm.label_smoothing == 0.0
        assert policy.lr == float(recipe_defaults()["lr"])  # what TRL's spec gets
    assert {"hpref-1-dpo", "hpref-2-dpo"} <= set(HPREF_CONTENDERS)
    assert {"trl-dpo-bf16", "trl-dpo-fp32", "trl-bf16"} <= set(TRL_CONTENDERS)


def test_dpo_table_gives_each_side_its_numbers_and_the_ratio():
    """The hpref row takes its DPO loss from its training rows (its reward_mean is pairwise, ~0.5),
    TRL's from its logs, and the ratio is hpref's seconds per update over TRL's."""
    measured = {"wall_s": 100.0, "peak_rss_gib": 3.0, "peak_pss_gib": 2.5, "load_mean": 1.0}
    rows = [
        {"loss": 0.69, "rewards_accuracy": 0.5, "judged_pairs": 8},
        {"loss": 0.60, "rewards_accuracy": 0.75, "judged_pairs": 8},
    ]
    hpref = {
        **measured,
        "seconds_per_update": 10.0,
        "seconds_per_update_steady": 9.0,
        "loop_to_last_update_s": 20.0,
        "a": {"gen_s_median": 4.0, **online_dpo_trl.hpref_fields(rows)},
    }
    got = {
        "wall_s": 40.0,
        "seconds_per_update": [19.0, 21.0],
        "generate_s_per_update": [12.0, 12.0],
        "mean_reward_per_update": [0.5, 0.7],
        "loss_per_update": [0.6931, 0.65],
        "accuracy_per_update": [0.0, 1.0],
        "kl_per_update": [0.0, 0.01],
    }
    trl = online_dpo_trl.trl_result(got, measured)
    assert trl["seconds_per_update"] == 20.0 and trl["a"]["loss_last_quarter"] == 0.65
    lines = online_dpo_trl.table({"hpref-1-dpo": hpref, "trl-dpo-bf16": trl})
    row = next(line for line in lines if line.startswith("| hpref-1-dpo |"))
    assert "0.6900 -> 0.6000" in row and "| 0.75 |" in row
    assert "hpref-1-dpo / trl-dpo-bf16 seconds per update: 0.50 (target <= 0.5)" in lines
