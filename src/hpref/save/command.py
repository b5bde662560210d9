"""The body of `hpref save`: a `SaveRequest` in, an exit code out.

`hpref.cli` owns the Typer signature, builds the request and calls `save_command`; every user mistake raises a
`UserError` (one line, exit 2), which the CLI's `main` already turns into its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpref.errors import UserError


@dataclass(frozen=True)
class SaveRequest:
    """`hpref save`'s options, built once by the CLI."""

    run_dir: str | Path
    to: str | Path | None = None
    step: str = "latest"
    dtype: str = "fp32"
    now: bool = False
    timeout: float = 1800.0
    overwrite: bool = False
    recipe: str | Path | None = None
    adapter: bool = False
    policy: str | None = None  # an rl run: the policy to export


def save_command(request: SaveRequest) -> int:
    """`hpref save`: export a checkpoint (`--to`), or with `--now` ask a live run for one first.
    A LoRA run exports merged weights, or with `adapter` PEFT's adapter folder and hpref's head; an
    rl run exports its policy `policy` as a causal-LM folder."""
    from hpref.runfolder.save_trigger import request_save_now
    from hpref.save.export import save_export

    run_dir, to, step, now = request.run_dir, request.to, request.step, request.now
    if now:
        path = request_save_now(run_dir, timeout=request.timeout)
        print(path)
        if to is None:
            return 0
        step = str(path)
    if to is None:
        raise UserError("hpref save needs --to DIR (or --now to only trigger a checkpoint)")
    source: str | Path = step if now else run_dir
    folder = save_export(
        source,
        to,
        step=None if now else step,  # type: ignore[arg-type]
        dtype=request.dtype,  # type: ignore[arg-type]
        recipe_path=request.recipe,
        overwrite=request.overwrite,
        adapter=request.adapter,
        policy=request.policy,
    )
    print(folder)
    return 0
