"""The component sections of `[rl]`: a registered component picked by `name`, its parameters beside
it (reward, eval scorer, prompts, engine, and each policy's algorithm), and their resolution against
the plugin registry (`hpref.recipe.schema.resolve_component`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpref.recipe.schema import resolve_component


class RewardSection(BaseModel):
    """`name` picks a registered reward component; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("rule", description="registered reward component (see `hpref components`)")


class PromptsSection(BaseModel):
    """`name` picks a registered prompt source; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("synthetic", description="registered prompt source (see `hpref components`)")


class EngineSection(BaseModel):
    """`name` picks a registered engine component; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field("transformers", description="registered engine component (see `hpref components`)")


class AlgorithmSection(BaseModel):
    """A policy's `algorithm`: a registered algorithm's name (`algorithm = "online-dpo"`) or a table
    with the name and its parameters (`algorithm = { name = "online-dpo", beta = 0.1 }`). GRPO's
    settings are the policy's own keys (`clip_low`, `kl_coef`, ...), as they were before algorithms
    were components."""

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


def resolve_engine(section: EngineSection, where: str = "recipe") -> BaseModel:
    """The engine component's validated config."""
    params = dict(section.model_extra or {})
    return resolve_component("engine", section.name, params, "rl.engine", where, plain_value_errors=True)


def resolve_algorithm(section: AlgorithmSection, policy: str, where: str = "recipe") -> BaseModel:
    """A policy's algorithm's validated config (`rl.policies.<policy>.algorithm`)."""
    key = f"rl.policies.{policy}.algorithm"
    return resolve_component("algorithm", section.name, section.params(), key, where, plain_value_errors=True)
