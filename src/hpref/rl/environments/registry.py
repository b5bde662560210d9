"""The one place a run's environment is built (`build_environment`: the rollout executor and the
preflight ask it), from whatever registered it: the built-ins or a plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpref.recipe.rl import RLConfig
    from hpref.rl.protocols import Environment


def build_environment(config: RLConfig, where: str = "recipe") -> Environment:
    """The `[rl.environment]` component, its parameters validated."""
    from hpref.errors import RecipeError
    from hpref.plugins import load_plugins
    from hpref.recipe.rl_components import resolve_environment

    if config.environment_config is None:
        config.environment_config = resolve_environment(config.environment, where)
    try:
        return load_plugins().get("environment", config.environment.name).build(config.environment_config)
    except RecipeError as exc:  # a build's own check (a tool that is not registered) names no file
        message = str(exc)
        raise RecipeError(message if message.startswith(f"{where}:") else f"{where}: {message}") from None


def policy_roles(
    config: RLConfig, environment: Environment, policies: list[str], where: str
) -> dict[str, str]:
    """The role each policy plays in its episodes: the role `[rl.environment] roles = { <role> =
    "<policy>" }` gives it, else the environment's first role; one line naming the key for a role the
    environment does not have or a policy the recipe does not declare."""
    from hpref.errors import RecipeError

    played: dict[str, str] = {}
    for role, policy in config.environment.roles.items():
        key = f"{where}: rl.environment.roles.{role}"
        if role not in environment.roles:
            raise RecipeError(
                f"{key}: the '{environment.name}' environment has no role '{role}' (its roles: "
                f"{', '.join(environment.roles)})"
            )
        if policy not in config.policies:
            raise RecipeError(
                f"{key}: '{policy}' is no policy of the recipe (its policies: {', '.join(config.policies)})"
            )
        if policy in played:
            raise RecipeError(
                f"{key}: '{policy}' already plays '{played[policy]}'; a policy plays one role in its episodes"
            )
        played[policy] = role
    return {p: played.get(p, environment.roles[0]) for p in policies}


def seated_roles(
    config: RLConfig, environment: Environment, policies: list[str], where: str
) -> dict[str, str] | None:
    """For an environment with several roles, the policy that plays each (`[rl.environment] roles`):
    every role played, by a policy this run trains, every such policy in a role, and one line naming
    the key otherwise. None for a one-role environment (each policy plays its own episodes)."""
    from hpref.errors import RecipeError

    if len(environment.roles) < 2:
        return None
    key = f"{where}: rl.environment.roles"
    roles = config.environment.roles
    for role, policy in roles.items():
        if role not in environment.roles:
            raise RecipeError(
                f"{key}.{role}: the '{environment.name}' environment has no role '{role}' (its roles: "
                f"{', '.join(environment.roles)})"
            )
        if policy not in policies:
            raise RecipeError(
                f"{key}.{role}: '{policy}' is not among the policies this run trains ({', '.join(policies)})"
            )
    unplayed = [r for r in environment.roles if r not in roles]
    if unplayed:
        example = ", ".join(f'{r} = "{policies[i % len(policies)]}"' for i, r in enumerate(environment.roles))
        raise RecipeError(
            f"{key}: the '{environment.name}' environment's role(s) {', '.join(unplayed)} have no policy; "
            f"name one for each ({{ {example} }})"
        )
    idle = [p for p in policies if p not in roles.values()]
    if idle:
        raise RecipeError(f"{key}: policy '{idle[0]}' plays no role of the '{environment.name}' environment")
    return {role: roles[role] for role in environment.roles}


def context_bound(config: RLConfig, policy: str) -> int:
    """The longest an episode's context may grow for `policy`: `max_context_tokens`, and never past
    a tiny policy's positions (the default, 2048, is past the tiny models' 512; a value the recipe
    sets past them is refused by `check_environment`)."""
    model = config.policies[policy].model
    bound = config.environment.max_context_tokens
    return bound if model.pretrained else min(bound, model.max_position_embeddings)


def check_environment(config: RLConfig, policies: list[str], where: str) -> dict[str, str] | None:
    """Before any actor starts: the environment builds from its parameters (a plugin's or a tool's
    own checks included), every role in `rl.environment.roles` is one it has, and an episode's
    context bound fits each tiny policy's positions; one line naming the key."""
    from hpref.errors import RecipeError

    environment = build_environment(config, where)
    seated = seated_roles(config, environment, policies, where)
    if seated is None:
        policy_roles(config, environment, policies, where)
    check_pair_judge(config, environment, where)
    check_shared_turn(config, environment, seated, where)
    bound = config.environment.max_context_tokens
    chosen = "max_context_tokens" in config.environment.model_fields_set
    for policy in policies:
        model = config.policies[policy].model
        if chosen and environment.name != "single-turn" and context_bound(config, policy) < bound:
            raise RecipeError(
                f"{where}: rl.environment.max_context_tokens: {bound} tokens is past policy '{policy}''s "
                f"{model.max_position_embeddings} positions (model.max_position_embeddings); lower it"
            )
    return seated


def check_shared_turn(
    config: RLConfig, environment: Environment, seated: dict[str, str] | None, where: str
) -> None:
    """An environment whose first turn is played once per start (`SharedTurn`: propose-solve's
    problem): that role's rows, one per start, are compared with each other, so a rollout needs two
    starts at least, and its policy plays no other role (whose rows come `group_size` per start: a
    rollout has one group size); one line naming the key."""
    from hpref.errors import RecipeError
    from hpref.rl.protocols import SharedTurn

    if not isinstance(environment, SharedTurn) or seated is None:
        return
    role, starts = environment.shared_role, config.rollout.prompts_per_rollout
    if starts < 2:
        raise RecipeError(
            f"{where}: rl.rollout.prompts_per_rollout is {starts}: the '{environment.name}' environment's "
            f"'{role}' plays one turn per start and its turns are compared with each other; use 2 or more"
        )
    policy = seated[role]
    also = [r for r, p in seated.items() if p == policy and r != role]
    if also:
        raise RecipeError(
            f"{where}: rl.environment.roles.{also[0]}: '{policy}' plays '{role}' too, whose rows are one per "
            f"start while '{also[0]}''s are {config.rollout.group_size} per start; give each its own policy"
        )


def check_pair_judge(config: RLConfig, environment: Environment, where: str) -> None:
    """An environment whose episodes are judged as pairs (`JudgedInPairs`: debate) needs rewards that
    judge pairs (`judges_pairs` on each one's config: the judge and rule rewards, a reward export),
    each weighed >= 0 (a verdict is their weighted mean); one line naming the key."""
    from hpref.errors import RecipeError
    from hpref.recipe.rl_rewards import pair_judging_fault
    from hpref.rl.protocols import JudgedInPairs

    fault = pair_judging_fault(config) if isinstance(environment, JudgedInPairs) else None
    if fault is None:
        return
    part, why = fault
    if why == "pairs":
        raise RecipeError(
            f"{where}: {part.key}: the '{environment.name}' environment's episodes are judged as answer "
            f"pairs, and the reward '{part.section.name}' does not judge pairs (judge and rule do)"
        )
    raise RecipeError(
        f"{where}: {part.key}.weight is {part.weight:g}: the '{environment.name}' environment's "
        f"verdicts are the rewards' weighted mean; use weights >= 0"
    )
