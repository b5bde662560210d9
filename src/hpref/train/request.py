"""`TrainRequest` and `InitRequest`: `hpref train`'s and `hpref init`'s options as one typed value
each (re-exported by `hpref.train.command`).

Its own module, importing nothing of hpref's, so the command and the launcher both read it without
importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainRequest:
    """`hpref train`'s options, built once by the CLI and handed down whole (command -> launch)."""

    recipe_path: Path
    overrides: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_timeout: int | None = None
    resume: str | None = None
    dry_run: bool = False
    overwrite: bool = False
    log: tuple[str, ...] = ()  # `--log`: metric loggers beside the recipe's `[logging] loggers`


@dataclass(frozen=True)
class InitRequest:
    """`hpref init`'s options, built once by the CLI and handed down whole (command -> `run_init`)."""

    recipe_path: Path
    overrides: tuple[str, ...] = ()
