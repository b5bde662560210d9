"""What `hpref rl` would refuse in a recipe beyond its types, checked before anything starts:
`preflight` before a run (it also reads the prompt file and decides `share_base`), `check_rl` for
`hpref recipes check`.

An `hpref rl` recipe trains no judge: its `[rl]` section was typed and checked when it loaded
(`hpref.recipe.rl`); here only what needs the policies' models or this machine: the adapters of its
policies (`[lora]` or `rl.policies.<id>.lora`: peft, and target modules each policy's LM has), the
megatron-core policies' architectures, policies that `share_base = true` asks to share one base,
and the reward exports and the warm-up's data file (this machine's files).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpref.builtin.rewards import check_reward_exports
from hpref.errors import RecipeError, UserError
from hpref.recipe import Recipe
from hpref.recipe.rl import RLConfig, resolve_engine
from hpref.recipe.rl_rewards import reward_parts, rl_rewards
from hpref.rl.algorithms.registry import check_algorithms
from hpref.rl.environments.registry import check_environment
from hpref.rl.trainer.backends import check_backends

if TYPE_CHECKING:
    from hpref.rl.protocols import PromptSource


def check_rl(recipe: Recipe, where: str | Path | None = None, *, machine: bool = True) -> None:
    """Raise `RecipeError` (one line) for the first thing `hpref rl` would refuse; `machine=False`
    leaves out what depends on this machine (`hpref recipes check --portable`)."""
    where = str(where if where is not None else recipe._source or "recipe")
    _check_rl_lora(recipe, where, machine)
    from hpref.rl.placement.engine_process import resolve_engine_process
    from hpref.rl.placement.shared_base import resolve_share_base

    assert recipe.rl is not None
    # every declared policy, in the recipe's order: `share_base = true` must hold for any of them
    resolve_share_base(recipe.rl, list(recipe.rl.policies), where)
    resolve_engine_process(recipe.rl, where)  # `engines_in_executor = true` for a vLLM or GPU engine
    if machine:
        _check_rl_backends(recipe, where)
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
    check_cast(config, sorted(config.policies), where)


def check_cast(config: RLConfig, policies: list[str], where: str) -> None:
    """Some policy learns; the environment (`environments.registry.check_environment`); and with
    several policies in its episodes (`roles`), no policy whose algorithm judges its answers in pairs."""
    from hpref.rl.algorithms.registry import build_algorithm

    if not any(config.policies[p].train for p in policies):
        raise RecipeError(
            f"{where}: rl.policies: every policy this run trains ({', '.join(policies)}) has train = false: "
            "nothing would learn"
        )
    seated = check_environment(config, policies, where)
    if seated is None:
        return
    for policy in policies:
        algorithm = build_algorithm(policy, config.policies[policy], where)
        if algorithm.needs_preferences:
            raise RecipeError(
                f"{where}: rl.policies.{policy}.algorithm: {algorithm.name} judges a policy's answers in "
                f"pairs, and in the '{config.environment.name}' environment policies play episodes together"
            )


def rl_config(recipe: Recipe) -> tuple[RLConfig, Path]:
    """The typed `[rl]` section of a Recipe (`hpref.recipe.rl`: validated once, when the recipe
    loaded, with the recipe's `[lora]` as every policy's default) and its run folder."""
    if recipe.rl is None:
        where = str(getattr(recipe, "_source", None) or "recipe")
        raise RecipeError(f"{where}: rl: the recipe has no [rl] section")
    return recipe.rl, Path(recipe.run.run_dir)


def preflight(recipe: Recipe, policies: list[str]) -> PromptSource:
    """Everything `hpref rl` checks before it writes anything or starts an actor, each mistake one
    line naming the key: adapters that fit their LM, megatron policies, policy folders that hold a
    causal LM with a chat template, the warm-up's data file, reward exports, and the prompt file,
    which is read here. Returns
    the built `[rl.prompts]` source."""
    from hpref.rl.policy import check_policy_models
    from hpref.rl.rollout.prompts import build_prompt_source

    config, _run_dir = rl_config(recipe)
    order = config.select(list(policies))
    where = str(getattr(recipe, "_source", None) or "recipe")
    if any(config.policies[p].lora is not None for p in order):
        from hpref.rl.policy import check_policy_lora

        # a wrong target name is one line here, not an actor that dies while it is being built
        check_policy_lora(config, order, where)
    check_backends(config, order, where)  # e.g. megatron-core there, and an architecture it maps
    check_algorithms(config, order, where)  # e.g. online DPO's pairs: an even group, a judging reward
    check_cast(config, order, where)  # its parameters and tools, the roles, the context bound
    check_policy_models(config, order, where)
    from hpref.rl.warmup.data import check_source

    check_source(config.warmup, where)  # its file and columns; its rows are read when it trains
    # an engine may refuse policies it cannot run (vLLM: head sizes its kernels lack)
    engine = config.engine_config or resolve_engine(config.engine, where)
    engine.check_policies(config, order, where)
    check_reward_exports(rl_rewards(config), where)
    prompts = build_prompt_source(config)
    check_rewards_fit_prompts(config, prompts, where)
    from hpref.rl.placement.engine_process import resolve_engine_process
    from hpref.rl.placement.shared_base import resolve_share_base

    # decided here, once, for the policies that run: the actors, rl.json and the plan read them
    recipe.rl = resolve_engine_process(resolve_share_base(config, order, where), where)
    return prompts


def check_rewards_fit_prompts(config: RLConfig, prompts: PromptSource, where: str) -> None:
    """Each reward can score these prompts, one line naming its key: the `rule` reward's built-in
    utility is the synthetic arena's judge (on other prompts it would score nonsense, so it needs
    prompts with a ground truth or a user `function`); a user function takes (prompt, answer) or
    (prompt, answer, row); the prompt file has the `columns` a reward reads from its rows."""
    from hpref.builtin.rewards import rule_function

    scorer = [("rl.eval_scorer", config.eval_scorer, config.eval_scorer_config)] if config.eval_scorer else []
    parts = [(p.key, p.section, p.config) for p in reward_parts(config)]
    available = tuple(getattr(prompts, "columns", ()))
    for key, section, validated in parts + scorer:
        function = getattr(validated, "function", None)
        if section.name == "rule" and function is None and not prompts.ground_truth:
            raise RecipeError(
                f"{where}: {key}.name: 'rule' scores with the synthetic arena's judge, which knows nothing "
                f"of the prompts from {prompts.source}; use a 'judge' (path = an `hpref save` export) or set "
                f"{key}.function = 'module:function'"
            )
        takes_row = False
        if section.name == "rule" and function is not None:
            try:
                _fn, takes_row = rule_function(function, key)
            except UserError as exc:
                raise RecipeError(f"{where}: {exc}") from None
        wanted = list(getattr(validated, "columns", None) or ())
        if wanted and not takes_row:
            raise RecipeError(
                f"{where}: {key}.columns: the function {function!r} takes (prompt, answer), so it never "
                "sees a row; give it a third parameter, row, or drop columns"
            )
        missing = [c for c in wanted if c not in available]
        if missing:
            raise RecipeError(
                f"{where}: {key}.columns: {', '.join(map(repr, missing))} not in the prompts from "
                f"{prompts.source} (its columns beside the conversation: {', '.join(available) or 'none'})"
            )
