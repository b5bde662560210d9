"""`hpref train` and `hpref init` from the command line: the run folder checks, then the launcher.

The order matters: the run folder is checked (and with `--overwrite` cleared) before any process
starts, so a fresh run never lands on another run's checkpoints; then
`hpref.train.launch.launch_train` validates the recipe and starts the workers. The CLI builds one
`TrainRequest` (`hpref init`: an `InitRequest`); it is handed down whole.
"""

from __future__ import annotations

from pathlib import Path

from hpref.train.request import InitRequest, TrainRequest

__all__ = ["InitRequest", "TrainRequest", "init_command", "train_command"]


def train_command(request: TrainRequest) -> int:
    """Check the run folder (`hpref.runfolder.start.prepare_train_run_folder`), then train
    (`hpref.train.launch.launch_train`); returns the exit code. Node 0 owns the run folder: the other
    nodes of a multi-node run leave it alone."""
    import hpref.train.launch
    from hpref.recipe import load_recipe
    from hpref.runfolder.start import prepare_train_run_folder

    loaded = load_recipe(request.recipe_path, list(request.overrides))
    nodes = request.nnodes or loaded.launch.nnodes
    rank = request.node_rank if request.node_rank is not None else loaded.launch.node_rank
    prepare_train_run_folder(
        loaded.run.run_dir,
        resume=request.resume,
        overwrite=request.overwrite,
        dry_run=request.dry_run,
        owner=nodes == 1 or rank == 0,
    )
    # read once in this process: the launcher checks it and hands it on
    return hpref.train.launch.launch_train(request, recipe=loaded)


def init_command(request: InitRequest) -> Path:
    """`hpref init`: build the recipe's model (backbone + new head) and write it to the run folder's
    `init/` (`hpref.train.launch.run_init`); returns the folder."""
    from hpref.train.launch import run_init

    return run_init(request.recipe_path, list(request.overrides))
