"""The component sections of `[rl]`: a registered component picked by `name`, its parameters beside
it (reward, eval scorer, prompts, engine, and each policy's algorithm), and their resolution against
the plugin registry (`hpref.recipe.schema.resolve_component`)."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpref.errors import RecipeError
from hpref.recipe.schema import resolve_component


class RewardSection(BaseModel):
    """`name` picks a registered reward component; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("rule", description="registered reward component (see `hpref components`)")


class WeightedRewardSection(RewardSection):
    """One of several rewards (`[rl.rewards.<name>]`): a reward component and its weight in the sum."""

    weight: float = Field(
        1.0,
        description="this reward's weight: an answer's reward is the weighted sum of the components' "
        "(0: logged, not trained on; negative: a penalty)",
    )


class PromptsSection(BaseModel):
    """`name` picks a registered prompt source; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("synthetic", description="registered prompt source (see `hpref components`)")


class EngineSection(BaseModel):
    """`name` picks a registered engine component; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("transformers", description="registered engine component (see `hpref components`)")


class EnvironmentSection(BaseModel):
    """`[rl.environment]`: `name` picks a registered environment (`single-turn`, every run's default;
    `tool`; a plugin's); `max_turns`, `max_context_tokens` and `roles` bound and cast every
    environment's episodes; every other key is one of the environment's parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(
        "single-turn", description="registered environment (see `hpref components environment`)"
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="the most turns a policy takes in one episode; an episode still going then ends, is "
        "trained on as far as it went and counted in `truncated_share`",
    )
    max_context_tokens: int = Field(
        2048,
        ge=16,
        description="the longest an episode's context may grow (prompt, turns and observations, in the "
        "policy's tokens, with room for one more answer of max_new_tokens; never past a tiny policy's "
        "positions); past it the episode ends as at max_turns",
    )
    roles: dict[str, str] = Field(
        default_factory=dict,
        description='the policy that plays each role, { <role> = "<policy id>" } (default: every policy '
        "plays the environment's first role, in episodes of its own)",
    )

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class AlgorithmSection(BaseModel):
    """A policy's `algorithm`: a registered algorithm's name (`algorithm = "online-dpo"`) or a table
    with the name and its parameters (`algorithm = { name = "grpo", kl_coef = 0.04 }`,
    `{ name = "online-dpo", beta = 0.1 }`); `[rl.defaults]`' table is merged under a policy's, key
    by key (a plain name replaces it)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("grpo", description="registered algorithm (see `hpref components algorithm`)")

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def resolve_reward(section: RewardSection, where: str = "recipe", key: str = "rl.reward") -> BaseModel:
    """A reward component's validated config (`key`: the section, for messages)."""
    params = dict(section.model_extra or {})
    return resolve_component("reward", section.name, params, key, where, plain_value_errors=True)


def resolve_prompts(section: PromptsSection, where: str = "recipe") -> BaseModel:
    """The prompt source's validated config."""
    params = dict(section.model_extra or {})
    return resolve_component("prompts", section.name, params, "rl.prompts", where, plain_value_errors=True)


#: What `hpref rl` reads of every engine's config (`hpref.rl.protocols.EngineConfig`, which a test
#: keeps equal to this): checked when the recipe loads, so a plugin's config class that lacks one is
#: one line there, not an AttributeError in the placement or the executor.
ENGINE_CONFIG_ATTRIBUTES = (
    "serves_adapters",
    "sampling_knobs",
    "num_cpus",
    "num_gpus",
    "dtype",
    "batch_rows",
    "check_policies",
    "check_adapters",
)


def resolve_engine(section: EngineSection, where: str = "recipe") -> BaseModel:
    """The engine component's validated config, refused in one line when its class lacks what
    `hpref rl` reads of every engine (`ENGINE_CONFIG_ATTRIBUTES`)."""
    params = dict(section.model_extra or {})
    config = resolve_component("engine", section.name, params, "rl.engine", where, plain_value_errors=True)
    missing = [name for name in ENGINE_CONFIG_ATTRIBUTES if not hasattr(config, name)]
    if missing:
        raise RecipeError(
            f"{where}: rl.engine.name: the '{section.name}' engine's config ({type(config).__name__}) has no "
            f"{', '.join(missing)}, which hpref rl reads of every engine; its plugin's config class should "
            "inherit hpref.rl.protocols.EngineConfigBase"
        )
    return config


def resolve_algorithm(section: AlgorithmSection, policy: str, where: str = "recipe") -> BaseModel:
    """A policy's algorithm's validated config (`rl.policies.<policy>.algorithm`)."""
    key = f"rl.policies.{policy}.algorithm"
    return resolve_component("algorithm", section.name, section.params(), key, where, plain_value_errors=True)


def resolve_environment(section: EnvironmentSection, where: str = "recipe") -> BaseModel:
    """The environment's validated config (`rl.environment`: its parameters, not the bounds)."""
    return resolve_component(
        "environment", section.name, section.params(), "rl.environment", where, plain_value_errors=True
    )


REWARD_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


def check_reward_sections(data: dict[str, Any], where: str) -> None:
    """`[rl.rewards.<name>]` sections: not beside `[rl.reward]`, names that make metric keys, and a
    weight that leaves the policies something to maximise; one line naming the key."""
    rewards = data.get("rewards")
    if rewards is None:
        return
    if "reward" in data:
        raise RecipeError(
            f"{where}: rl.rewards: the recipe has both [rl.reward] and [rl.rewards.<name>] sections; "
            "keep one (several rewards go in [rl.rewards.<name>], each with a weight)"
        )
    if not isinstance(rewards, dict) or not rewards:
        raise RecipeError(
            f"{where}: rl.rewards: declare each reward as [rl.rewards.<name>] with its name = ..."
        )
    weights = {}
    for name, table in rewards.items():
        if not REWARD_NAME.match(name):
            raise RecipeError(
                f"{where}: rl.rewards.{name}: a reward's name is 1-32 lowercase letters, digits or '_', "
                "starting with a letter (it names its metrics: reward_<name>_mean)"
            )
        if name == "start" or name.endswith("_start"):  # eval_reward_start is the sum's start mean
            raise RecipeError(
                f"{where}: rl.rewards.{name}: a reward's name may not end in 'start' (its eval metrics "
                "would read as the start's: eval_reward_<name>_start); rename it"
            )
        if not isinstance(table, dict):
            raise RecipeError(f"{where}: rl.rewards.{name}: expected a table")
        weight = table.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise RecipeError(f"{where}: rl.rewards.{name}.weight: expected a number, got {weight!r}")
        weights[name] = float(weight)
    if all(w <= 0 for w in weights.values()):
        listed = ", ".join(f"{n} = {w:g}" for n, w in weights.items())
        raise RecipeError(
            f"{where}: rl.rewards: every weight is zero or negative ({listed}); at least one reward needs "
            "a positive weight, or the policies have nothing to maximise"
        )
