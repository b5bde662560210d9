"""Finding recipes: a path or the name of a shipped recipe, and the listing `hpref recipes` prints.

Shipped recipes live in `HPREF_RECIPES`, else the `recipes/` folder of a source checkout (an editable
install), else the copy a wheel carries as `hpref/recipes` (setup.py). Every command that takes a
recipe accepts either a path or such a name (`hpref train quickstart`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hpref.errors import RecipeError, UserError, did_you_mean


def shipped_recipes_dir() -> Path | None:
    """Where the shipped recipes are: `HPREF_RECIPES`, else the `recipes/` folder of this source
    checkout (an editable install), else the copy a wheel carries as `hpref/recipes` (setup.py)."""
    env = os.environ.get("HPREF_RECIPES")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]  # src/hpref (this module is hpref/recipe/catalog.py)
    for folder in (package.parents[1] / "recipes", package / "recipes"):
        if folder.is_dir():
            return folder
    return None


def resolve_recipe_path(name_or_path: str) -> Path:
    """A path as given, or the name of a shipped recipe (`quickstart` -> recipes/quickstart.toml).

    A bare name that is neither is a `RecipeError` suggesting the nearest shipped recipe."""
    path = Path(name_or_path)
    if path.exists() or path.suffix == ".toml" or os.sep in name_or_path:
        return path
    shipped = shipped_recipes_dir()
    if shipped is not None and (shipped / f"{name_or_path}.toml").exists():
        return shipped / f"{name_or_path}.toml"
    names = sorted(p.stem for p in shipped.glob("*.toml")) if shipped is not None else []
    hint = did_you_mean(name_or_path, names) or (f"; shipped: {', '.join(names)}" if names else "")
    raise RecipeError(f"{name_or_path}: no such file, nor a shipped recipe of that name{hint}")


def recipe_summary(path: Path) -> dict[str, Any]:
    """One row of `hpref recipes list`: name, path, model, training data, the first comment line."""
    from hpref.recipe.loading import read_toml

    data = read_toml(path)
    first_line = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            first_line = line.lstrip("# ").strip()
            break
    model = data.get("model", {}).get("name", "-") if isinstance(data.get("model"), dict) else "-"
    dpo = data.get("dpo")
    if isinstance(dpo, dict) and isinstance(dpo.get("model"), dict):  # a DPO recipe's policy
        policy = dpo["model"]
        model = f"dpo: {policy.get('name') or policy.get('path') or 'tiny'}"
    train = data.get("dataset", {}).get("train", {}) if isinstance(data.get("dataset"), dict) else {}
    return {
        "name": path.stem,
        "path": str(path),
        "model": model,
        "dataset": train.get("name", "-") if isinstance(train, dict) else "-",
        "description": first_line,
    }


def list_recipes(folders: list[Path] | None = None) -> list[dict[str, Any]]:
    """The shipped recipes and those in `folders`, one summary row each; a recipe that does not
    read is listed with `INVALID: <why>` as its description rather than ending the listing."""
    search = [d for d in [shipped_recipes_dir()] if d is not None] + list(folders or [])
    rows = []
    for folder in search:
        if not folder.is_dir():
            raise RecipeError(f"{folder}: not a folder")
        for path in sorted(folder.glob("*.toml")):
            try:
                rows.append(recipe_summary(path))
            except UserError as exc:
                rows.append(
                    {
                        "name": path.stem,
                        "path": str(path),
                        "model": "-",
                        "dataset": "-",
                        "description": f"INVALID: {exc}",
                    }
                )
    return rows
