"""Recipes: typed TOML files that say what to train and how (`hpref.recipe.loading`), with the
blocks every section is made of (`schema`), the typed `[rl]` section (`rl`) and the shipped-recipe
lookup (`catalog`). What a command checks beyond the types lives with the command
(`hpref.train.checks`, `hpref.rl.control.preflight`).

This package sits low, above the plugins and the core: it imports nothing of the commands,
components or models, so any layer can read a recipe.
"""

from hpref.recipe.loading import (
    REMOTE_CODE_KEY,
    DatasetSection,
    LaunchSection,
    OptimizerSection,
    Recipe,
    RunSection,
    TrainSection,
    apply_overrides,
    dump_toml,
    load_recipe,
    parse_override,
    read_toml,
    recipe_from_dict,
    remote_code_keys,
    resolve_components,
)
from hpref.recipe.rl import RLConfig, parse_rl_section
from hpref.recipe.schema import ComponentSection, LoraSection, Section, describe_error, resolve_component

__all__ = [
    "REMOTE_CODE_KEY",
    "ComponentSection",
    "DatasetSection",
    "LaunchSection",
    "LoraSection",
    "OptimizerSection",
    "RLConfig",
    "Recipe",
    "RunSection",
    "Section",
    "TrainSection",
    "apply_overrides",
    "describe_error",
    "dump_toml",
    "load_recipe",
    "parse_override",
    "parse_rl_section",
    "read_toml",
    "recipe_from_dict",
    "remote_code_keys",
    "resolve_component",
    "resolve_components",
]
