"""What a run writes into its run folder when it starts: the resolved recipe and a full log file.

`hpref train` (its rank-0 worker) and `hpref rl` both start here, so every run folder holds the
same two things a reader needs first: `recipe.toml`, the recipe with every default filled in (export
and eval rebuild the model from it), and `logs/<name>.log`, the run's DEBUG log. Before a fresh
training run starts, `prepare_train_run_folder` refuses (or with `--overwrite` clears) a folder that
already holds another run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loguru import logger

from hpref.errors import UserError
from hpref.runfolder.files import write_text_atomic
from hpref.runfolder.heartbeat import run_status
from hpref.runfolder.layout import LOGS, RECIPE, check_folder_path, prepare_fresh_run


def log_file(run_dir: str | Path, name: str) -> Path:
    """The full log of one process of a run: `<run_dir>/logs/<name>.log` (`rank0`, `rl`)."""
    return Path(run_dir) / LOGS / f"{name}.log"


#: Set by `hpref train`'s launcher for its torchrun workers: the resolved recipe it checked and wrote
#: (their `--recipe` and `--set` arguments, kept so the printed command stays the whole truth, are
#: then not read).
RESOLVED_RECIPE_ENV = "HPREF_RESOLVED_RECIPE"


def write_resolved_recipe(recipe: Any, run_dir: str | Path | None = None) -> Path:
    """The resolved recipe as `recipe.toml` in the run folder (default: the recipe's own), written
    atomically: a crash mid-write must leave the old file, not half of one."""
    folder = Path(run_dir) if run_dir is not None else Path(recipe.run.run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(folder / RECIPE, recipe.to_toml())


def start_run_folder(recipe: Any, name: str) -> Path:
    """At run start, in the process that owns the run: the resolved recipe as `recipe.toml`, and a
    full (DEBUG) log file `<run_dir>/logs/<name>.log` beside the console. Returns the log file."""
    from hpref.logs import add_log_file

    run_dir = Path(recipe.run.run_dir)
    write_resolved_recipe(recipe, run_dir)
    path = log_file(run_dir, name)
    add_log_file(path)
    logger.info(f"run folder {run_dir}: resolved recipe in {RECIPE}, full log in {path}")
    return path


def prepare_train_run_folder(
    run_dir: str | Path, *, resume: str | None, overwrite: bool, dry_run: bool, owner: bool
) -> None:
    """Before any training process starts: the run folder must be a folder, and a fresh run must not
    land on another run (see `hpref.runfolder.layout`); `--overwrite` deletes that run's own files
    first, unless that run is still alive. `owner`: this node owns the run folder (node 0: on a
    shared file system a later node would otherwise delete, or refuse because of, what node 0 has
    just started writing). A dry run changes nothing."""
    run_dir = Path(run_dir)
    check_folder_path(run_dir, "run folder (run.output_dir / run.name)")
    if overwrite and resume is not None:
        raise UserError("--overwrite deletes the run that --resume would continue: pass one of them")
    if dry_run or resume is not None or not owner:
        return
    if overwrite:
        alive, reason = run_status(run_dir)
        if alive:
            raise UserError(f"{run_dir}: --overwrite refused, the run there is still training ({reason})")
    removed = prepare_fresh_run(run_dir, overwrite=overwrite)
    if removed:
        names = ", ".join(p.name for p in removed)
        logger.warning(f"--overwrite: deleted the earlier run's {names} in {run_dir}")
