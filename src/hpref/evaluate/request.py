"""`EvalRequest`: `hpref eval`'s options as one typed value (re-exported by `hpref.evaluate.command`).

Its own module, importing nothing of hpref's, so the command, the launcher, the runner and the
worker all read it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EvalRequest:
    """`hpref eval`'s options, built once by the CLI and handed down whole: to `run_eval` here, or
    through the launcher's JSON spec to every rank (`hpref.evaluate.worker`)."""

    recipe: str | Path | None = None
    checkpoint: str | Path | None = None
    data: str | Path | None = None
    out: str | Path | None = None
    tta: str = "none"
    ensemble: Sequence[str | Path] = ()
    weights: str | None = None
    fit_weights: bool = False
    soft_labels: str | Path | None = None
    overrides: Sequence[str] = ()
    micro_batch_tokens: int | None = None
    plot: bool = True
    nproc_per_node: int | None = None
