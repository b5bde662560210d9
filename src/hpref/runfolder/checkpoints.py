"""Finding and checking the saves in a run folder, before anything reads a tensor from them.

A training run keeps DCP checkpoints as `checkpoints/step-NNNNNN/` (written by
`hpref.train.checkpoint`): a folder of that name is complete by construction (it is renamed into
place after every rank wrote its part), `.tmp-*` folders are saves that did not finish, and
`checkpoints/latest` names the newest (a save whose pointer write failed is found through the
lineage each save records: `hpref.runfolder.lineage`). An `hpref rl` run keeps its global saves as
`checkpoints/rollout-NNNNNN/`, one sub-folder per trainer plus the executor's (written after every
trainer's, so a save that holds it is whole), and the newest complete one is the folder its
`record.json` names (`hpref.runfolder.record`).

Here is every question asked of those folders: which saves are complete (`complete_checkpoints`,
`complete_saves`, `rl_saves`), which is the newest (`find_latest`) and which an auto resume may
fall back to (`timeline`), which one a user means
(`resolve_checkpoint`, `resolve_rl_save`), and whether one is safe to read (`validate_checkpoint`:
checksums, the index through the one restricted reader of `hpref.runfolder.safe_load`, shard sizes,
tensor shapes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loguru import logger

from hpref.errors import UserError
from hpref.runfolder import lineage
from hpref.runfolder.integrity import require_verified
from hpref.runfolder.layout import (
    CHECKPOINT_INDEX,
    CHECKPOINTS,
    EXECUTOR_STATE,
    LATEST,
    RECORD_FILE,
    RL_EXECUTOR,
    RL_JSON,
    ROLLOUT_PREFIX,
    STEP_PREFIX,
    TMP_PREFIX,
    TRAIN_STATE,
)
from hpref.runfolder.lineage import LINEAGE_KEY, Lineage
from hpref.runfolder.record import read_record
from hpref.runfolder.safe_load import CheckpointError, read_dcp_index


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def is_complete(folder: Path) -> bool:
    """A training checkpoint folder holding its DCP index and its train state."""
    return (folder / CHECKPOINT_INDEX).is_file() and (folder / TRAIN_STATE).is_file()


def step_of(folder: Path) -> int:
    return int(folder.name.removeprefix(STEP_PREFIX))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete training checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and is_complete(p)]
    return sorted(found, key=step_of)


def recorded_rl_save(run_dir: Path) -> Path | None:
    """The newest complete global save of an `hpref rl` run (the one its record names), or None."""
    record = read_record(Path(run_dir))
    if record is None or not record.save_dir:
        return None
    folder = Path(run_dir) / record.save_dir
    return folder if folder.is_dir() else None


def complete_saves(run_dir: Path) -> list[Path]:
    """Every complete save of a run, oldest first: the `step-*` checkpoints of a training run, or the
    `rollout-*` save an `hpref rl` run's record names (a record names only its newest save)."""
    saves = complete_checkpoints(run_dir)
    recorded = recorded_rl_save(run_dir)
    if recorded is not None:
        saves.append(recorded)
    return saves


def train_lineage(folder: Path) -> Lineage | None:
    """The lineage a training checkpoint records in its `train_state.json` (`hpref.runfolder.lineage`),
    None for one of an older hpref version (or a state that does not parse: verification says why)."""
    try:
        state = json.loads((Path(folder) / TRAIN_STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return Lineage.from_json(state.get(LINEAGE_KEY)) if isinstance(state, dict) else None


def pointer_target(run_dir: Path) -> Path | None:
    """The complete checkpoint `checkpoints/latest` names, or None (no pointer, or it names none)."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    named = root / pointer.read_text().strip()
    return named if named.is_dir() and is_complete(named) else None


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of the run's current timeline, or None: the one `latest` names,
    or the newest that continues it when the pointer's write after a save failed (a full disk;
    `hpref.runfolder.lineage`). Partial ones (`.tmp-*`, or a `step-*` folder missing its metadata)
    are ignored with a warning; a `latest` pointer to a missing folder is not trusted (the newest
    checkpoint then)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    for p in sorted(root.iterdir()):
        if p.is_dir() and (
            p.name.startswith(TMP_PREFIX) or (p.name.startswith(STEP_PREFIX) and not is_complete(p))
        ):
            logger.warning(f"ignoring partial checkpoint {p} (a save that did not finish)")
    complete = complete_checkpoints(run_dir)
    pointer = root / LATEST
    named = pointer_target(run_dir)
    if named is None:
        if pointer.is_file():
            logger.warning(
                f"{pointer} names '{pointer.read_text().strip()}', which is not a complete checkpoint; "
                "scanning instead"
            )
        return complete[-1] if complete else None
    newest = lineage.head(named, complete, train_lineage)
    if newest != named:
        logger.warning(
            f"{pointer} names {named.name}, and {newest.name} continues it (the pointer's write after "
            f"that save did not finish): {newest.name} is the run's newest checkpoint"
        )
    return newest


def timeline(run_dir: Path) -> list[Path]:
    """The run's current timeline, newest first: `find_latest`'s checkpoint and the kept ones it
    descends from (what `--resume auto` falls back to, never an abandoned timeline's saves)."""
    newest = find_latest(run_dir)
    if newest is None:
        return []
    return lineage.ancestors(newest, complete_checkpoints(run_dir), train_lineage)


def _rl_save_error(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: an hpref rl save (its policies' causal LMs and the rollout position), not a "
        "preference-model checkpoint; export one of its policies with --policy ID"
    )


def rl_save_name(rollout: int) -> str:
    return f"{ROLLOUT_PREFIX}{rollout:06d}"


def is_rl_save(path: Path) -> bool:
    """Whether `path` names one global save of an `hpref rl` run (`RUN/checkpoints/rollout-*`)."""
    return path.name.startswith(ROLLOUT_PREFIX) and path.parent.name == CHECKPOINTS


def is_rl_run(path: Path) -> bool:
    """Whether `path` is an `hpref rl` run folder: its `rl.json`, its record, or its `rollout-*` saves."""
    path = Path(path)
    if (path / RL_JSON).is_file() or (path / RECORD_FILE).is_file():
        return True
    root = path / CHECKPOINTS
    return root.is_dir() and any(p.name.startswith(ROLLOUT_PREFIX) for p in root.iterdir())


def rl_saves(run_dir: Path) -> list[Path]:
    """The whole global saves of an `hpref rl` run, oldest first: those holding the executor's part,
    which the leader writes after every trainer's (a `rollout-*` folder without it did not finish)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(ROLLOUT_PREFIX)
        and p.name.removeprefix(ROLLOUT_PREFIX).isdigit()
        and (p / RL_EXECUTOR / EXECUTOR_STATE).is_file()
    ]
    return sorted(found, key=lambda p: int(p.name.removeprefix(ROLLOUT_PREFIX)))


def resolve_rl_save(run_dir: Path, step: str | int | None = "latest") -> Path:
    """The global save of an `hpref rl` run a user means: `latest` (None) is the one its record names,
    what `--resume auto` continues from; `rollout-N` or `N` an older one `keep_last` kept."""
    run_dir = Path(run_dir)
    if step in (None, "latest"):
        recorded = recorded_rl_save(run_dir)
        if recorded is None:
            raise CheckpointError(
                f"{run_dir}: the rl run has no complete save yet (no {RECORD_FILE} names one)"
            )
        return recorded
    number = str(step).removeprefix(ROLLOUT_PREFIX)
    if not number.isdigit():
        raise UserError(f"--step {step!r}: expected latest, rollout-N or a rollout number")
    folder = Path(run_dir) / CHECKPOINTS / rl_save_name(int(number))
    saves = rl_saves(run_dir)
    if folder not in saves:
        what = "did not finish: it has no executor part" if folder.is_dir() else "does not exist"
        names = ", ".join(p.name for p in saves) or "none"
        raise CheckpointError(
            f"{run_dir}: no save at rollout {int(number)} ({folder.name} {what}); its saves: {names}"
        )
    return folder


def resolve_checkpoint(path: str | Path, step: str | int | None = "latest") -> Path:
    """A checkpoint folder from a run folder (`step` = "latest" or a step number) or a checkpoint
    folder itself (`step` ignored)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run or checkpoint folder")
    if (path / CHECKPOINT_INDEX).exists() or path.name.startswith((STEP_PREFIX, TMP_PREFIX)):
        return path
    if is_rl_save(path):
        raise _rl_save_error(path)
    if not (path / CHECKPOINTS).is_dir():
        raise CheckpointError(f"{path}: neither a run folder (no {CHECKPOINTS}/) nor a checkpoint folder")
    if step in (None, "latest"):
        found = find_latest(path)
        if found is None:
            recorded = recorded_rl_save(path)
            if recorded is not None:
                raise _rl_save_error(recorded)
            raise CheckpointError(f"{path}: the run has no complete checkpoint yet")
        return found
    try:
        number = int(step)
    except ValueError:
        raise UserError(f"--step {step!r}: expected a step number or 'latest'") from None
    folder = path / CHECKPOINTS / checkpoint_name(number)
    if not folder.is_dir():
        raise CheckpointError(f"{path}: no checkpoint for step {number} ({folder} does not exist)")
    return folder


def validate_checkpoint(path: Path, expected: dict[str, Any] | None = None, prefix: str = "model.") -> Any:
    """Check a training checkpoint before reading a tensor; returns its DCP index.

    Refused: a partial save, files that do not match the checksums recorded at save time, an index
    that names anything outside the exact allow-list (`safe_load`), a missing or truncated shard, and
    (with `expected`, model keys without `prefix` -> tensors of the wanted shapes) a checkpoint of
    another model.
    """
    path = Path(path)
    if path.name.startswith(TMP_PREFIX):
        raise CheckpointError(
            f"{path}: a partial checkpoint (a save that did not finish); use a step-* folder"
        )
    if not (path / TRAIN_STATE).is_file():
        raise CheckpointError(
            f"{path}: no {TRAIN_STATE}, so the save did not finish; refusing a partial checkpoint"
        )
    require_verified(path)
    index = read_dcp_index(path)
    sizes: dict[str, int] = {}
    for info in (getattr(index, "storage_data", None) or {}).values():
        # checkpoints of older hpref versions have no checksums: at least refuse missing or
        # truncated shard files before DCP reads past their end
        name = str(info.relative_path)
        if name not in sizes:
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"{path}: shard file {name} is missing; refusing a partial checkpoint")
            sizes[name] = file.stat().st_size
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(
                f"{path}: shard file {name} is truncated ({sizes[name]} bytes, the index needs "
                f"{info.offset + info.length}); refusing a corrupt checkpoint"
            )
    if expected is not None:
        stored = index.state_dict_metadata
        missing = [k for k in expected if prefix + k not in stored]
        if missing:
            raise CheckpointError(
                f"{path}: {len(missing)} model tensors are not in the checkpoint (first: {missing[0]}); "
                "was it written for a different model?"
            )
        for key, tensor in expected.items():
            meta = stored[prefix + key]
            shape = tuple(getattr(meta, "size", ()))
            if shape != tuple(tensor.shape):
                raise CheckpointError(
                    f"{path}: tensor {key} has shape {list(shape)} in the checkpoint and "
                    f"{list(tensor.shape)} in the recipe's model; was it written for a different model?"
                )
    return index
