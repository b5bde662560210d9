"""What a run folder holds: the names hpref writes there, and the checks that keep runs from being lost.

A run folder (`run.output_dir / run.name`) is shared by the user: people keep notes, exports and
their own scripts beside a run. So hpref only ever deletes the entries it knows it wrote (`OWNED`),
and decides "this folder already holds a run" from the entries only a started run leaves
(`RUN_MARKERS`): `hpref init`'s `init/` and `recipe.toml` are the input of the run about to start,
and a start that failed during set-up leaves only logs, so neither blocks a fresh `hpref train`.

Why a fresh start into an existing run is refused: checkpoint pruning keeps the highest step numbers,
so the old run's checkpoints outlive the new run's, `latest` ends up pointing at a deleted folder,
`metrics.jsonl` is cut, and `hpref save` exports the old weights under the new recipe.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hpref.errors import UserError

# The one place these names are spelt: every reader and writer of a run folder imports them from here.
RECIPE = "recipe.toml"  # the resolved recipe the launcher writes; workers and `hpref save` read it
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PREDICTIONS = "predictions.csv"
PREDICTIONS_DIR = "predictions"
STEP_PREDICTIONS = "step-{step:06d}.csv"  # in PREDICTIONS_DIR: one eval's predictions
BASELINE_PREDICTIONS = "baseline-{name}.csv"  # in PREDICTIONS_DIR: a cheap baseline's eval predictions
LOGS = "logs"
HEARTBEAT = "heartbeat.json"
SAVE_NOW = "SAVE_NOW"
INIT = "init"  # `hpref init`'s weights, which a fresh run starts from
RL_JSON = "rl.json"
RL_SUMMARY = "rl_summary.json"
RL_METRICS = "metrics"
RL_EVAL_ANSWERS = "eval_answers"  # in RL_METRICS: the answers of each eval, per policy
EVAL = "eval"  # `hpref eval`'s default output folder inside a run folder
EVAL_PREDICTIONS = "predictions.csv"  # ... and its default predictions file there

# Inside CHECKPOINTS: a train run's `step-NNNNNN/` saves and the `latest` pointer, an rl run's global
# `rollout-NNNNNN/` saves and their `record.json`; a save is written under a `.tmp-` name first.
LATEST = "latest"
TMP_PREFIX = ".tmp-"
STEP_PREFIX = "step-"
ROLLOUT_PREFIX = "rollout-"
RECORD_FILE = "record.json"
# Inside one save: DCP's index, the train state, the checksums, an rl trainer's optimizer state.
CHECKPOINT_INDEX = ".metadata"
TRAIN_STATE = "train_state.json"
CHECKSUMS = "checksums.json"
TRAINER_STATE = "trainer.pt"
# Inside an rl global save: one folder per policy, holding its trainer's state and `POLICY_MODEL/` (a
# transformers folder) unless it trained LoRA adapters; and the executor's part, its data positions.
POLICY_MODEL = "model"
RL_EXECUTOR = "executor"
EXECUTOR_STATE = "executor.json"

# The metric loggers' files (`hpref.builtin.loggers`): TensorBoard's default event folder, the offline
# W&B runs (wandb names its folder `wandb/`), the W&B run id a resume continues and the steps it reached.
TENSORBOARD = "tensorboard"
WANDB = "wandb"
WANDB_RUN_ID = "wandb_run_id.txt"
WANDB_STEPS = "wandb_steps.json"

#: Entries a started training or RL run leaves: any of them means the folder holds a run.
#: (Not `predictions.csv`: `hpref eval` writes that name too, in folders that hold no run.)
RUN_MARKERS = (CHECKPOINTS, METRICS, SUMMARY, HEARTBEAT, RL_JSON, RL_SUMMARY)
#: Every top-level entry hpref's train and rl write in a run folder (what `--overwrite` may delete).
#: `init/` is not here: `hpref init` writes it for the run that is about to start from it.
OWNED = (
    *RUN_MARKERS,
    PREDICTIONS,
    PREDICTIONS_DIR,
    RECIPE,
    LOGS,
    SAVE_NOW,
    RL_METRICS,
    TENSORBOARD,
    WANDB,
    WANDB_RUN_ID,
    WANDB_STEPS,
)

# Temporary names of the owned files, left by a write that was killed: `.NAME.<pid>.part` (atomic
# writes), `NAME.part` (prediction files) and `NAME.tmp` (metrics.jsonl's rewrite on resume).
_TEMP = re.compile(r"^(?:\.(?P<a>.+)\.\d+\.part|(?P<b>.+)\.(?:part|tmp))$")


def side_files(out: str | Path) -> tuple[Path, Path]:
    """The metrics JSON and reliability PNG that belong to the predictions file `out`, named after it
    (`x.csv` -> `x.metrics.json`, `x.reliability.png`), so two evaluations written to one folder,
    or a user's own `metrics.json` there, are never replaced by another output's numbers."""
    out = Path(out)
    return out.with_name(f"{out.stem}.metrics.json"), out.with_name(f"{out.stem}.reliability.png")


def _is_owned(name: str) -> bool:
    if name in OWNED:
        return True
    match = _TEMP.match(name)
    return bool(match) and (match.group("a") or match.group("b")) in OWNED


def run_markers(run_dir: str | Path) -> list[str]:
    """The entries of `run_dir` that show a run was started there (empty folders do not count)."""
    run_dir = Path(run_dir)
    found = []
    for name in RUN_MARKERS:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            if any(path.iterdir()):
                found.append(name + "/")
        elif path.exists() or path.is_symlink():
            found.append(name)
    return found


def holds_run(run_dir: str | Path) -> bool:
    return bool(run_markers(run_dir))


def looks_like_run(folder: str | Path) -> bool:
    """A run folder: it holds a run, or a resolved recipe hpref wrote for one."""
    folder = Path(folder)
    return holds_run(folder) or (folder / RECIPE).is_file()


def is_checkpoint(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / CHECKPOINT_INDEX).is_file() or (
        folder.name.startswith("step-") and folder.parent.name == CHECKPOINTS
    )


def owner_of(path: str | Path) -> str | None:
    """Why `path` belongs to a run or a checkpoint (so an output must not be written there), or None.

    `path` is owned when it, or a folder above it, is a checkpoint folder, or is one of `OWNED` in a
    run folder (e.g. `RUN/checkpoints/x`, `RUN/summary.json`, `RUN/logs/`). A new name of the
    user's choosing inside a run folder (`RUN/export`, `RUN/eval/x.csv`) is not owned.
    """
    path = Path(path).resolve()
    for item in (path, *path.parents):
        if is_checkpoint(item):
            return f"{item} is a checkpoint folder"
        if item.name in OWNED and looks_like_run(item.parent):
            return f"{item} is the run {item.parent}'s own {item.name}"
    return None


def check_folder_path(folder: str | Path, what: str) -> None:
    """Refuse a folder path that is, or lies under, an existing non-folder (one line, before any
    process starts, instead of NotADirectoryError in every worker)."""
    folder = Path(folder)
    for item in (folder, *folder.parents):
        if item.is_dir():
            return
        if item.exists() or item.is_symlink():
            if item == folder:
                raise UserError(f"{what} {folder}: is a file, not a folder")
            raise UserError(f"{what} {folder}: cannot be a folder, {item} is a file")


def clear_run(run_dir: str | Path) -> list[Path]:
    """Delete the run hpref wrote in `run_dir`: only the `OWNED` entries (and their temporary names)
    and `hpref eval`'s default outputs in `eval/`; everything else stays. Returns what was deleted.

    A symlink is removed as a link; nothing it points to is touched.
    """
    run_dir = Path(run_dir)
    removed: list[Path] = []
    if not run_dir.is_dir():
        return removed
    for entry in sorted(run_dir.iterdir()):
        if _is_owned(entry.name):
            _remove(entry)
            removed.append(entry)
    eval_dir = run_dir / EVAL
    if eval_dir.is_dir() and not eval_dir.is_symlink():
        predictions = eval_dir / EVAL_PREDICTIONS
        for path in (predictions, *side_files(predictions)):
            if path.exists() or path.is_symlink():
                _remove(path)
                removed.append(path)
        if not any(eval_dir.iterdir()):
            eval_dir.rmdir()
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def prepare_fresh_run(run_dir: str | Path, *, overwrite: bool) -> list[Path]:
    """Before a fresh (not resumed) training run starts in `run_dir`: refuse a folder that already
    holds a run unless `overwrite`, in which case that run's files are deleted. Returns them."""
    run_dir = Path(run_dir)
    found = run_markers(run_dir)
    if not found:
        return []
    if not overwrite:
        raise UserError(
            f"{run_dir} already holds a run ({', '.join(found)}): continue it with --resume auto, "
            "pick another run.name (--set run.name=NEW), or pass --overwrite to delete that run's files"
        )
    return clear_run(run_dir)
