"""The one place a policy's algorithm is built (`build_algorithm`: the trainer, the rollout executor and
the launcher's checks all ask it), from whatever registered it: the built-ins
(`hpref.rl.algorithms.builtin`) or a plugin, through the registry. It imports no algorithm, so a room
that builds one (the rollout executor) depends on the `Algorithm` protocol only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpref.recipe.rl import PolicyConfig, RLConfig
    from hpref.rl.protocols import Algorithm


def build_algorithm(policy: str, settings: PolicyConfig, where: str = "recipe") -> Algorithm:
    """The policy's algorithm, its parameters validated (`rl.policies.<policy>.algorithm`)."""
    from hpref.plugins import load_plugins
    from hpref.recipe.rl_components import resolve_algorithm

    config = resolve_algorithm(settings.algorithm, policy, where)
    return load_plugins().get("algorithm", settings.algorithm.name).build(config, settings)


def check_algorithms(config: RLConfig, policies: list[str], where: str) -> None:
    """Before any actor starts: each policy's algorithm accepts the run's settings, and an algorithm
    that trains on judged pairs has rewards whose configs say they judge pairs (`judges_pairs`: the
    built-in judge and rule rewards; `hpref.rl.protocols.PairJudge`), with no negative weight (a
    verdict is the rewards' weighted mean: `hpref.rl.rollout.rewards`), one line naming the key."""
    from hpref.errors import RecipeError
    from hpref.recipe.rl_rewards import pair_judging_fault

    fault = pair_judging_fault(config)
    for policy in policies:
        algorithm = build_algorithm(policy, config.policies[policy], where)
        algorithm.check(policy, config, policies, where)
        if not algorithm.needs_preferences or fault is None:
            continue
        key, (part, why) = f"{where}: rl.policies.{policy}.algorithm", fault
        if why == "pairs":
            raise RecipeError(
                f"{key}: {algorithm.name} trains on judged answer pairs, and the reward "
                f"'{part.section.name}' does not judge pairs ({part.key}; judge and rule do)"
            )
        raise RecipeError(
            f"{key}: {algorithm.name}'s pair verdicts are the rewards' weighted mean, and "
            f"{part.key}.weight is {part.weight:g}; use weights >= 0"
        )
