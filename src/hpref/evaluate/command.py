"""The body of `hpref eval`: an `EvalRequest` in, an exit code out.

`hpref.cli` owns the Typer signature, builds the request and calls `eval_command`; every user
mistake raises a `UserError` (one line, exit 2), which the CLI's `main` already turns into its
message.
"""

from __future__ import annotations

from pathlib import Path

from hpref.errors import UserError
from hpref.evaluate.request import EvalRequest

__all__ = ["EvalRequest", "eval_command"]


def eval_command(request: EvalRequest, *, device: str = "cpu") -> int:
    """`hpref eval`: predictions for every battle (model or ensemble), metrics when labelled.

    Checks the request, then runs `hpref.evaluate.runner.run_eval` here, or with
    `nproc_per_node > 1` on that many processes started through torchrun (`hpref.evaluate.launch`,
    each rank a `hpref.evaluate.worker`); rank 0 writes every output.
    """
    if request.tta not in ("none", "swap"):
        raise UserError(f"--tta {request.tta!r}: expected none or swap")
    _check_outputs(out=request.out, soft_labels=request.soft_labels)
    if request.nproc_per_node is not None and request.nproc_per_node > 1:
        if request.ensemble:
            raise UserError(
                "--nproc-per-node applies to model predictions; an --ensemble blend runs in one process"
            )
        if request.checkpoint is None or request.recipe is None:
            raise UserError("--nproc-per-node needs a recipe and --checkpoint")
        from hpref.evaluate.launch import launch_eval
        from hpref.recipe import load_recipe

        run_dir = load_recipe(request.recipe, list(request.overrides)).run.run_dir
        return launch_eval(request, request.nproc_per_node, run_dir)
    from hpref.evaluate.runner import run_eval

    return run_eval(request, device=device)


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
