"""`hpref train` and `hpref init` from the command line: the run folder checks, then the launcher.

The order matters: the run folder is checked (and with `--overwrite` cleared) before any process
starts, so a fresh run never lands on another run's checkpoints; then `hpref.train.launch.run_train`
validates the recipe and starts the workers.
"""

from __future__ import annotations

from pathlib import Path


def train_command(
    recipe_path: Path,
    overrides: list[str],
    *,
    nproc_per_node: int | None,
    nnodes: int | None,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    rdzv_timeout: int | None,
    resume: str | None,
    dry_run: bool,
    overwrite: bool,
) -> int:
    """Check the run folder (`hpref.runfolder.start.prepare_train_run_folder`), then train; returns
    the exit code. Node 0 owns the run folder: the other nodes of a multi-node run leave it alone."""
    from hpref.recipe import load_recipe
    from hpref.runfolder.start import prepare_train_run_folder
    from hpref.train.launch import run_train

    loaded = load_recipe(recipe_path, overrides)
    nodes = nnodes or loaded.launch.nnodes
    rank = node_rank if node_rank is not None else loaded.launch.node_rank
    prepare_train_run_folder(
        loaded.run.run_dir,
        resume=resume,
        overwrite=overwrite,
        dry_run=dry_run,
        owner=nodes == 1 or rank == 0,
    )
    return run_train(
        recipe_path,
        overrides,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_timeout=rdzv_timeout,
        resume=resume,
        dry_run=dry_run,
        recipe=loaded,  # read once in this process: the launcher checks it and hands it on
    )


def init_command(recipe_path: Path, overrides: list[str]) -> Path:
    """`hpref init`: build the recipe's model (backbone + new head) and write it to the run folder's
    `init/` (`hpref.train.launch.run_init`); returns the folder."""
    from hpref.train.launch import run_init

    return run_init(recipe_path, overrides)
