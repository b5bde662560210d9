"""The body of `hpref save`: plain arguments in, an exit code out.

`hpref.cli` owns the Typer signature and calls `save_command`; every user mistake raises a
`UserError` (one line, exit 2), which the CLI's `main` already turns into its message.
"""

from __future__ import annotations

from pathlib import Path

from hpref.errors import UserError


def save_command(
    run_dir: str | Path,
    *,
    to: str | Path | None = None,
    step: str = "latest",
    dtype: str = "fp32",
    now: bool = False,
    timeout: float = 1800.0,
    overwrite: bool = False,
    recipe: str | Path | None = None,
    adapter: bool = False,
) -> int:
    """`hpref save`: export a checkpoint (`--to`), or with `--now` ask a live run for one first.
    A LoRA run exports merged weights, or with `adapter` PEFT's adapter folder and hpref's head."""
    from hpref.runfolder.save_trigger import request_save_now
    from hpref.save.export import save_export

    if now:
        path = request_save_now(run_dir, timeout=timeout)
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
        dtype=dtype,  # type: ignore[arg-type]
        recipe_path=recipe,
        overwrite=overwrite,
        adapter=adapter,
    )
    print(folder)
    return 0
