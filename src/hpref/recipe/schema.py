"""The building blocks every recipe section is made of, shared by `hpref.recipe` and its `[rl]`
section (`hpref.recipe.rl`):

- `Section`: a typed table whose unknown keys are an error; `ComponentSection`: `name` picks a
  registered component and every other key is one of its parameters;
- `LoraSection`: the `[lora]` table, which `[rl]` policies reuse for their own adapters;
- `describe_error`: the one builder of the one-line message for a validation error (the dotted
  key, what is wrong, the nearest valid key);
- `resolve_component`: the one resolver of a component section against the plugin registry.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from hpref.errors import RecipeError, UserError, did_you_mean


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ComponentSection(BaseModel):
    """`name` picks a registered component; every other key is one of its parameters."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(description="registered component name (see `hpref components`)")
    _config: BaseModel | None = PrivateAttr(default=None)

    @property
    def config(self) -> BaseModel:
        if self._config is None:
            raise RuntimeError(f"component section '{self.name}' was not resolved against the registry")
        return self._config

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class LoraSection(Section):
    """LoRA adapters through PEFT (`pip install 'hpref[lora]'`): the backbone's weights stay frozen
    and low-rank updates of its attention and MLP projections train, with the preference head (and a
    reward model's BERT pooler) in full. Without this section the whole model trains."""

    r: int = Field(8, ge=1, description="rank of each low-rank update")
    alpha: int | None = Field(
        None, ge=1, description="scale numerator: an update is scaled by alpha / r (default: 2 r)"
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapters' input (off, like the backbone's: see model.backbone_dropout)",
    )
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description=(
            "module names (PEFT's suffix match) that get adapters; default: every linear layer inside "
            "the transformer blocks (BERT query/key/value/dense, Llama q/k/v/o/gate/up/down_proj)"
        ),
    )
    quantize_base: Literal["none", "4bit"] = Field(
        "none",
        description=(
            "4bit = QLoRA: the frozen block projections in 4-bit NF4 (bitsandbytes, hpref[qlora]; "
            "CUDA or CPU)"
        ),
    )

    @property
    def scale_alpha(self) -> int:
        return self.alpha if self.alpha is not None else 2 * self.r


# --------------------------------------------------------------------------------------------------
# errors and components


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that owns the last element of `loc` (for key suggestions)."""
    current: type[BaseModel] | None = model
    for part in loc[:-1]:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return current


def describe_error(
    exc: ValidationError, model: type[BaseModel], prefix: tuple[str, ...], *, plain_value_errors: bool = False
) -> str:
    """One line for the first validation error: dotted key, what was wrong, a suggestion.

    `rl.policies.a.lr: Input should be greater than 0, got -1`; an unknown key names the nearest
    valid one and lists the valid keys (a field marked `exclude=True` is internal, never listed).
    `plain_value_errors` drops pydantic's "Value error, " before a validator's own message, as the
    `[rl]` section's messages always have (the other sections' messages keep it, as they always had).
    """
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in (*prefix, *loc)) or "(top level)"
    kind = err["type"]
    if kind == "extra_forbidden":
        owner = _model_at(model, loc)
        fields = [name for name, info in (owner.model_fields if owner else {}).items() if not info.exclude]
        if owner is ComponentSection:
            return f"{key}: unknown key{did_you_mean(str(loc[-1]), fields)}"
        return f"{key}: unknown key{did_you_mean(str(loc[-1]), fields)}; valid keys: {', '.join(fields)}"
    if kind == "missing":
        return f"{key}: required key is missing"
    msg = err["msg"].rstrip(".")
    if plain_value_errors:
        msg = msg.removeprefix("Value error, ")
    got = err.get("input")
    if isinstance(got, dict):  # a whole-section check (a model validator): the message says it all
        return f"{key}: {msg}"
    got_text = json.dumps(got, default=str)
    if len(got_text) > 60:
        got_text = got_text[:57] + "..."
    return f"{key}: {msg}, got {got_text}"


def resolve_component(
    kind: str, name: str, params: dict[str, Any], key: str, where: str, *, plain_value_errors: bool = False
) -> BaseModel:
    """The validated config of the registered `kind` component `name` from its parameters (the keys
    beside `name` in the section at dotted `key`); a `RecipeError` naming `<where>: <key>...`
    (`plain_value_errors`: see `describe_error`)."""
    from hpref.plugins import load_plugins

    registry = load_plugins()
    try:
        component = registry.get(kind, name)
    except UserError as exc:
        raise RecipeError(f"{where}: {key}.name: {exc}") from None
    try:
        return component.config.model_validate(params)
    except ValidationError as exc:
        message = describe_error(
            exc, component.config, tuple(key.split(".")), plain_value_errors=plain_value_errors
        )
        raise RecipeError(f"{where}: {message}") from None
