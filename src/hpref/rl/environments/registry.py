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


def check_environment(config: RLConfig, policies: list[str], where: str) -> None:
    """Before any actor starts: the environment builds from its parameters (a plugin's or a tool's
    own checks included), every role in `rl.environment.roles` is one it has, and an episode's
    context bound fits each tiny policy's positions; one line naming the key."""
    from hpref.errors import RecipeError

    environment = build_environment(config, where)
    policy_roles(config, environment, policies, where)
    bound = config.environment.max_context_tokens
    for policy in policies:
        model = config.policies[policy].model
        if (
            environment.name != "single-turn"
            and not model.pretrained
            and bound > model.max_position_embeddings
        ):
            raise RecipeError(
                f"{where}: rl.environment.max_context_tokens: {bound} tokens is past policy '{policy}''s "
                f"{model.max_position_embeddings} positions (model.max_position_embeddings); lower it"
            )
