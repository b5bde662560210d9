"""`hpref data stats`: a data file's or a recipe dataset's statistics (`hpref.stats.counts`), with
the recipe's components built for it when asked for token counts.

It sits at the command layer, beside train/evaluate/rl, because it builds components from a
recipe; `hpref.stats.counts` itself only reads battles and counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpref.stats.counts import data_stats, open_data_file


@dataclass(frozen=True)
class StatsRequest:
    """`hpref data stats`'s options, built once by the CLI and handed down whole.

    `source` is a data file or a recipe (a path or a shipped recipe's name); with `tokens` the
    battles are also formatted and tokenized, by the recipe's model and formatter (a data file takes
    them from `recipe_for_tokens`)."""

    source: str
    split: str = "train"
    tokens: bool = False
    recipe_for_tokens: str | None = None
    on_error: str = "raise"
    ceilings: bool = False
    overrides: Sequence[str] = ()


def stats_command(request: StatsRequest) -> dict[str, Any]:
    """`hpref data stats`: the statistics of a data file, or of a recipe's dataset section (see
    `StatsRequest`). Every misuse of the options is a `RecipeError` of one line."""
    from hpref.errors import RecipeError
    from hpref.recipe.catalog import resolve_recipe_path

    split, tokens, on_error = request.split, request.tokens, request.on_error
    recipe_for_tokens, overrides = request.recipe_for_tokens, list(request.overrides)
    path = resolve_recipe_path(request.source)
    is_recipe = path.suffix == ".toml"
    if is_recipe and (recipe_for_tokens is not None or on_error != "raise"):
        raise RecipeError("--recipe and --on-error are for a data file; a recipe brings its own")
    if on_error not in ("raise", "skip"):
        raise RecipeError(f"--on-error {on_error!r}: expected raise or skip")
    if tokens and not is_recipe and recipe_for_tokens is None:
        raise RecipeError(
            "--tokens on a data file needs --recipe RECIPE (the model whose tokenizer, and the formatter)"
        )
    recipe = None
    if is_recipe or recipe_for_tokens is not None:
        from hpref.components import Components
        from hpref.recipe import load_recipe

        recipe_path = path if is_recipe else resolve_recipe_path(recipe_for_tokens)  # type: ignore[arg-type]
        recipe = load_recipe(recipe_path, overrides)
        parts = Components(recipe)
    elif overrides:
        raise RecipeError("--set needs a recipe (the source or --recipe)")
    if is_recipe:
        if split not in ("train", "eval"):
            raise RecipeError(f"--split {split!r}: expected train or eval")
        section = getattr(recipe.dataset, split)
        if section is None:
            raise RecipeError(f"{path}: dataset.{split}: the recipe has no such section")
        data = parts.source(split)
    else:
        data = open_data_file(path, seed=0, on_error=on_error)
    formatter = None
    if tokens:
        if recipe.model is None:
            raise RecipeError(f"{recipe_path}: --tokens needs a [model] section (for its tokenizer)")
        formatter = parts.formatter(parts.model(meta=True, adapters=False).tokenizer)
    return data_stats(data, formatter, ceilings=request.ceilings)
