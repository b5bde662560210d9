"""The body of `hpref eval`: plain arguments in, an exit code out.

`hpref.cli` owns the Typer signatures and calls these; every user mistake raises a `UserError`
(one line, exit 2), which the CLI's `main` already turns into its message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpref.errors import UserError


def eval_command(
    recipe: str | Path | None,
    *,
    checkpoint: str | Path | None = None,
    data: str | Path | None = None,
    out: str | Path | None = None,
    tta: str = "none",
    ensemble: list[str | Path] | None = None,
    weights: str | None = None,
    fit_weights: bool = False,
    soft_labels: str | Path | None = None,
    overrides: list[str] | None = None,
    micro_batch_tokens: int | None = None,
    plot: bool = True,
    device: str = "cpu",
    nproc_per_node: int | None = None,
) -> int:
    """`hpref eval`: predictions for every battle (model or ensemble), metrics when labelled.

    Checks the arguments, then runs `hpref.evaluate.runner.run_eval` here, or with
    `nproc_per_node > 1` on that many processes started through torchrun (`hpref.evaluate.launch`,
    each rank a `hpref.evaluate.worker`); rank 0 writes every output.
    """
    if tta not in ("none", "swap"):
        raise UserError(f"--tta {tta!r}: expected none or swap")
    _check_outputs(out=out, soft_labels=soft_labels)
    arguments: dict[str, Any] = dict(
        checkpoint=checkpoint, data=data, out=out, tta=tta, ensemble=ensemble, weights=weights,
        fit_weights=fit_weights, soft_labels=soft_labels, overrides=overrides,
        micro_batch_tokens=micro_batch_tokens, plot=plot,
    )  # fmt: skip
    if nproc_per_node is not None and nproc_per_node > 1:
        if ensemble:
            raise UserError(
                "--nproc-per-node applies to model predictions; an --ensemble blend runs in one process"
            )
        if checkpoint is None or recipe is None:
            raise UserError("--nproc-per-node needs a recipe and --checkpoint")
        from hpref.evaluate.launch import launch_eval
        from hpref.recipe import load_recipe

        run_dir = load_recipe(recipe, overrides).run.run_dir
        return launch_eval({"recipe": recipe, **arguments}, nproc_per_node, run_dir)
    from hpref.evaluate.runner import run_eval

    return run_eval(recipe, device=device, **arguments)


def _check_outputs(**paths: str | Path | None) -> None:
    """Refuse an output that would land in a run's own files or a checkpoint (a predictions file in
    `checkpoints/` would be pruned with it, or break it), before any model is loaded."""
    from hpref.runfolder.layout import owner_of, side_files

    for option, path in paths.items():
        if path is None:
            continue
        targets = (Path(path), *side_files(path)) if option == "out" else (Path(path),)
        for target in targets:
            reason = owner_of(target)
            if reason is not None:
                flag = "--" + option.replace("_", "-")
                raise UserError(f"{flag} {path}: {reason}; write outputs outside it")
