"""Build hook: ship the top-level `recipes/` inside the wheel as `hpref/recipes/`.

All metadata lives in pyproject.toml. This file only exists because the recipes sit beside `src/`
(where a newcomer looks for them) rather than inside the package: without the copy, an installed
wheel would have no `quickstart` recipe and `hpref recipes list` would be empty outside a checkout.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithRecipes(build_py):
    def run(self) -> None:
        super().run()
        source = Path(__file__).resolve().parent / "recipes"
        target = Path(self.build_lib) / "hpref" / "recipes"
        target.mkdir(parents=True, exist_ok=True)
        for recipe in sorted(source.glob("*.toml")):
            shutil.copy2(recipe, target / recipe.name)


setup(cmdclass={"build_py": BuildPyWithRecipes})
