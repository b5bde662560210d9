"""`hpref recipes check`: load and check each recipe as the command it is for does before it
starts anything: `hpref.train.checks.check_train` for a training recipe, `hpref.rl.control.preflight.check_rl`
for an `hpref rl` recipe (which trains no judge, so is not held to training).

It sits above the command packages because it asks both of them; they never ask each other.
"""

from __future__ import annotations

from collections.abc import Iterator


def check_recipes(items: list[str], overrides: list[str], *, portable: bool) -> Iterator[str]:
    """Yield one `ok` line per recipe (a path or a shipped recipe's name); raise the first
    `RecipeError`. `portable` leaves out what depends on this machine."""
    from hpref.recipe import load_recipe
    from hpref.recipe.catalog import resolve_recipe_path
    from hpref.rl.control.preflight import check_rl
    from hpref.train.checks import check_train, is_rl_recipe

    for item in items:
        path = resolve_recipe_path(item)
        resolved = load_recipe(path, overrides)
        check = check_rl if is_rl_recipe(resolved) else check_train
        check(resolved, path, machine=not portable)
        parts = ", ".join(f"{dotted}={sec.name}" for dotted, _kind, sec in resolved.component_sections())
        yield f"ok  {path}  ({parts})"
