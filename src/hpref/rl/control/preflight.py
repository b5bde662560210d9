"""What `hpref rl` would refuse in a recipe beyond its types, checked before anything starts.

An `hpref rl` recipe trains no judge: its `[rl]` section was typed and checked when it loaded
(`hpref.recipe.rl`); here only what needs the policies' models or this machine: the adapters of its
policies (`[lora]` or `rl.policies.<id>.lora`: peft, and target modules each policy's LM has), the
megatron-core policies' architectures, policies that `share_base = true` asks to share one base,
and the reward exports and the warm-up's data file (this machine's files).
"""

from __future__ import annotations

from pathlib import Path

from hpref.errors import RecipeError
from hpref.recipe import Recipe


def check_rl(recipe: Recipe, where: str | Path | None = None, *, machine: bool = True) -> None:
    """Raise `RecipeError` (one line) for the first thing `hpref rl` would refuse; `machine=False`
    leaves out what depends on this machine (`hpref recipes check --portable`)."""
    where = str(where if where is not None else recipe._source or "recipe")
    _check_rl_lora(recipe, where, machine)
    from hpref.rl.placement.shared_base import resolve_share_base

    assert recipe.rl is not None
    # every declared policy, in the recipe's order: `share_base = true` must hold for any of them
    resolve_share_base(recipe.rl, list(recipe.rl.policies), where)
    if machine:
        _check_rl_backends(recipe, where)
        from hpref.builtin.rewards import check_reward_exports
        from hpref.recipe.rl_rewards import rl_rewards

        check_reward_exports(rl_rewards(recipe.rl), where)  # the exports are this machine's files
        from hpref.rl.warmup.data import check_source

        check_source(recipe.rl.warmup, where)  # the warm-up's data file, its columns


def _check_rl_lora(recipe: Recipe, where: str, machine: bool) -> None:
    """`hpref rl` policies with adapters (the top-level `[lora]` or a policy's `lora` table): peft
    installed, and target modules every such policy's LM has (from its architecture alone; a policy
    whose model is a local folder only with `machine`, since the folder is this machine's)."""
    import importlib.util

    config = recipe.rl  # typed when the recipe loaded, with `[lora]` as every policy's default
    assert config is not None
    with_lora = sorted(p for p, policy in config.policies.items() if policy.lora is not None)
    if not with_lora:
        return
    if importlib.util.find_spec("peft") is None:
        if not machine:
            return
        raise RecipeError(f"{where}: lora: LoRA adapters need the peft package: pip install 'hpref[lora]'")
    from hpref.rl.policy import check_policy_lora

    check_policy_lora(config, with_lora, where, skip_paths=not machine)


def _check_rl_backends(recipe: Recipe, where: str) -> None:
    """Each policy's trainer backend can be built here (`hpref.rl.trainer.backends`: for
    `trainer_backend = "megatron"`, megatron-core installed and an architecture it maps)."""
    from hpref.rl.algorithms.registry import check_algorithms
    from hpref.rl.trainer.backends import check_backends

    config = recipe.rl
    assert config is not None
    check_backends(config, sorted(config.policies), where)
    check_algorithms(config, sorted(config.policies), where)
