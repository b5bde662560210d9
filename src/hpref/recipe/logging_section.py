"""`[logging]`: the metric loggers of a train or rl run (`hpref.builtin.loggers`, the `logger` kind).

    [logging]
    loggers = ["tensorboard", "wandb"]   # beside metrics.jsonl, which is always written
    [logging.wandb]                      # a logger's parameters (`hpref components logger`)
    mode = "online"

`--log NAME` (repeatable) on `hpref train` and `hpref rl` adds to `loggers`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from hpref.errors import RecipeError, UserError


class LoggingSection(BaseModel):
    """`loggers` picks registered loggers; every other key is a table of one logger's parameters."""

    model_config = ConfigDict(extra="allow")

    loggers: list[str] = Field(
        default_factory=list, description="metric loggers beside metrics.jsonl: tensorboard, wandb, ..."
    )
    _configs: dict[str, BaseModel] = PrivateAttr(default_factory=dict)

    def params(self, name: str) -> dict[str, Any]:
        value = (self.model_extra or {}).get(name, {})
        return dict(value) if isinstance(value, dict) else value

    def add(self, names: tuple[str, ...] | list[str]) -> None:
        """Loggers named on the command line (`--log`), after the recipe's, each once."""
        self.loggers = list(dict.fromkeys([*self.loggers, *names]))

    def configs(self) -> dict[str, BaseModel]:
        """The selected loggers' validated configs (after `resolve`), in the recipe's order."""
        return {name: self._configs[name] for name in self.loggers if name in self._configs}

    def resolve(self, where: str) -> None:
        """Validate the names against the registry and each logger's table against its config: an
        unknown name or key is a `RecipeError` naming it (a table for a logger not selected is
        checked too: `--log` may select it)."""
        from hpref.plugins import load_plugins
        from hpref.recipe.schema import resolve_component

        registry = load_plugins()
        for key, names in (("loggers", self.loggers), ("", list(self.model_extra or {}))):
            for name in names:
                try:
                    registry.get("logger", name)
                except UserError as exc:
                    dotted = f"logging.{key}" if key else f"logging.{name}"
                    raise RecipeError(f"{where}: {dotted}: {exc}") from None
        for name in dict.fromkeys([*self.loggers, *(self.model_extra or {})]):
            params = self.params(name)
            if not isinstance(params, dict):
                raise RecipeError(f"{where}: logging.{name}: expected a table of the logger's parameters")
            self._configs[name] = resolve_component("logger", name, params, f"logging.{name}", where)


def add_loggers(recipe: Any, names: tuple[str, ...] | list[str], where: str = "--log") -> None:
    """Add the loggers `--log` names to `recipe` (a `Recipe`), validated like the recipe's own."""
    if not names:
        return
    if recipe.logging is None:
        recipe.logging = LoggingSection()
    recipe.logging.add(names)
    recipe.logging.resolve(where)
