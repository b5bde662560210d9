"""Error types that decide how the CLI ends.

`UserError` is anything the user can fix (a bad recipe, an unknown component, a bad flag): the CLI
prints its message as one line and exits 2. Anything else is a bug in hpref or a plugin: exit 1,
with the traceback kept in the log file.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """A mistake in the user's input; printed as one line, exit code 2."""

    exit_code = 2


class RecipeError(UserError):
    """A recipe (file or --set override) that does not validate."""


class ComponentError(UserError):
    """An unknown component name, or a plugin conflict."""


class DataError(UserError):
    """A data file or row that cannot be read."""


class TrainingDiverged(UserError):
    """The loss or the gradient norm became NaN/inf: the run stops before it can save the damage.
    Exit code 3, so a script can tell a diverged run from a bad recipe."""

    exit_code = 3


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`" (did you mean 'x'?)"` for the nearest candidate, or `""` when nothing is close."""
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
