"""Training checkpoints: torch.distributed.checkpoint (DCP) for the tensors, JSON for the rest.

Layout of a run folder's `checkpoints/`:

    step-000040/          a complete checkpoint (only ever created by a rename)
      .metadata, *.distcp   DCP: model and optimizer, sharded as they were trained; only what trains
                            (with LoRA: adapters and head, not the frozen base weights)
      train_state.json      step, sampler position, scheduler, world size (identical on every rank);
                            with LoRA also `base_model`, the recipe's [model] that gives the base;
                            `lineage`: its id and the checkpoint it continued from
      rank-00000.json       that rank's RNG states (CPU, CUDA, Python, NumPy)
      checksums.json        size and SHA-256 of every file above
    .tmp-step-000050/     being written, or left behind by a crash: never loaded
    latest                the name of the newest complete checkpoint (replaced atomically); a
                            resume first points it at the checkpoint it resumed from

Why this shape
- A checkpoint is written to `.tmp-step-N` and renamed to `step-N` by rank 0 after a barrier, so a
  folder named `step-N` is complete by construction; a crash mid-save leaves only a `.tmp-*`.
- Nothing arbitrary is unpickled on load: the small state is JSON, and the DCP files are read by
  `hpref.runfolder.safe_load` (the one reader every path uses: an exact allow-list for `.metadata`,
  `torch.load(weights_only=True)` for every item).
- Nothing corrupt is trusted: `checksums.json` holds the size and SHA-256 of every file (each rank
  hashes and fsyncs a share), the folder is renamed into place only after that, and `latest` moves
  only after the rename is durable. Resume verifies the checksums first; `--resume auto` falls back
  to the newest checkpoint of the run's timeline that verifies, and says so.
- A `latest` whose write failed (a full disk, after the rename) does not send a resume one save
  back: each checkpoint records the one it continued from (`hpref.runfolder.lineage`), and the
  newest checkpoint is `latest`'s target or the newest that descends from it. Not simply the newest
  folder: after a resume from an older checkpoint, the newer ones are an abandoned timeline.
- RNG state is per rank (dropout draws differ by rank), so each rank saves and reloads its own file;
  resuming with a different world size is refused rather than silently changing the run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from loguru import logger

from hpref.errors import UserError
from hpref.models.parallelize import checkpoint_layout
from hpref.runfolder import integrity, lineage
from hpref.runfolder.checkpoints import (
    checkpoint_name,
    complete_checkpoints,
    find_latest,
    is_complete,
    pointer_target,
    step_of,
    timeline,
    train_lineage,
)
from hpref.runfolder.files import fsync_dir, write_json_atomic, write_text_atomic
from hpref.runfolder.layout import CHECKPOINTS, LATEST, TMP_PREFIX, TRAIN_STATE
from hpref.runfolder.safe_load import CheckpointError, UnsafeCheckpointError, dcp_load

# Re-exported: callers catch the errors from here, and find the layout names beside the writer.
__all__ = [
    "CHECKPOINTS",
    "LATEST",
    "TMP_PREFIX",
    "TRAIN_STATE",
    "CheckpointError",
    "UnsafeCheckpointError",
    "checkpoint_name",
    "complete_checkpoints",
    "find_latest",
]


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _problems(folder: Path) -> list[str]:
    """Collective when a process group exists: what is wrong with a checkpoint's files ([] = it
    verifies; an older checkpoint without checksums counts as verified, with a warning)."""
    problems = integrity.verify(folder, collective=True)
    if integrity.is_unverified_only(problems):
        logger.warning(problems[0])
        return []
    return problems


def _newest_verified(run_dir: Path, flag: str) -> Path | None:
    """The newest checkpoint of the run's timeline whose files verify; each one skipped is said,
    with why."""
    for candidate in timeline(run_dir):
        problems = _problems(candidate)
        if not problems:
            _VERIFIED.add(candidate)
            return candidate
        logger.warning(f"{flag}: skipping {candidate}: {problems[0]}; trying an older checkpoint")
    return None


# checkpoints verified by this process already, so that `load_checkpoint` does not hash them twice
_VERIFIED: set[Path] = set()


def resolve_resume(run_dir: Path, resume: str | Path | None) -> Path | None:
    """`--resume auto` -> the newest complete checkpoint that verifies (None for a fresh run; an
    error when checkpoints exist but none verifies); a path -> that checkpoint, which must be
    complete. Collective when a process group exists (ranks share the hashing)."""
    if resume is None:
        return None
    if str(resume) == "auto":
        if not complete_checkpoints(run_dir):
            find_latest(run_dir)  # warns about partial checkpoints
            logger.info(
                f"--resume auto: no complete checkpoint under {Path(run_dir) / CHECKPOINTS}; starting fresh"
            )
            return None
        latest = find_latest(run_dir)
        found = _newest_verified(run_dir, "--resume auto")
        if found is None:
            raise CheckpointError(
                f"--resume auto: no checkpoint under {Path(run_dir) / CHECKPOINTS} verifies (see the "
                "warnings above); refusing to start over a damaged run"
            )
        if found != latest:
            logger.warning(f"--resume auto: resuming from {found.name}, the newest checkpoint that verifies")
        return found
    path = Path(resume)
    if path.is_dir() and not is_complete(path) and (path / CHECKPOINTS).is_dir():
        if not complete_checkpoints(path):
            raise UserError(f"--resume {path}: the run folder has no complete checkpoint")
        found = _newest_verified(path, f"--resume {path}")
        if found is None:
            raise CheckpointError(f"--resume {path}: no checkpoint of the run folder verifies")
        return found
    if not path.is_dir() or not is_complete(path):
        raise UserError(
            f"--resume {path}: not a complete checkpoint folder (expected .metadata and {TRAIN_STATE})"
        )
    return path


# --------------------------------------------------------------------------------------------------
# RNG state as JSON


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "python": _jsonable(random.getstate()),
    }
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(_tupled(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _tupled(value: Any) -> Any:
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


# --------------------------------------------------------------------------------------------------
# save / load


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    keep: int,
    rank_state: dict[str, Any] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final `step-N` folder. `train_state` is rank
    0's (the same on every rank); `rank_state` is each rank's own (a pipeline stage's scheduler,
    whose parameter groups differ by stage), written beside its RNG state."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.api import CheckpointException

    rank, world = _rank_and_world()
    root = Path(run_dir) / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optim_state = _trained_state(model, optimizer)
    try:
        save(checkpoint_layout(model, model_state, optim_state), checkpoint_id=str(tmp))
    except CheckpointException as exc:  # a BaseException: the worker's `except Exception` misses it
        raise _save_failure(tmp, exc) from None
    write_json_atomic(tmp / _rank_file(rank), {**(rank_state or {}), "rank": rank, "rng": rng_state()})
    if rank == 0:
        # the checkpoint `latest` names is the one this run continued from (a resume points it there)
        born = lineage.child_of(final.name, pointer_target(run_dir), train_lineage)
        state = {**train_state, "step": step, "world_size": world, lineage.LINEAGE_KEY: born.to_json()}
        write_json_atomic(tmp / TRAIN_STATE, state)
    _barrier()
    # every file is complete: hash (and fsync) them, each rank a share, before the folder may count
    integrity.write_manifest(tmp, collective=True)
    _barrier()
    if rank == 0:
        if final.exists():  # the same step saved twice (an interval that is also an epoch end)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)  # the rename is on disk before `latest` names it
        write_text_atomic(root / LATEST, final.name + "\n")
        # keep the newest `keep` by step number, counting the one just written: a checkpoint with a
        # higher step than this one is never the thing to delete
        older = [p for p in complete_checkpoints(run_dir) if step_of(p) < step]
        for old in older[: max(len(older) - (keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info(f"checkpoint {final}")
    _barrier()
    return final


def _save_failure(tmp: Path, exc: BaseException) -> RuntimeError:
    """DCP's failed save as one line: every rank gets one multi-line `CheckpointException` holding
    each failing rank's error and traceback; name the first failing rank and its error's first line."""
    failures = getattr(exc, "failures", None) or {}
    rank, cause = min(failures.items()) if failures else ("?", exc)
    if isinstance(cause, tuple):  # (exception, traceback)
        cause = cause[0]
    first = (str(cause).strip().splitlines() or [""])[0]
    return RuntimeError(f"checkpoint {tmp} not written: rank {rank}: {type(cause).__name__}: {first}")


def _trained_only(strict: bool = True) -> Any:
    """DCP's state-dict options: only parameters that train. A LoRA checkpoint then holds the
    adapters, the head and their optimizer state, not the frozen base, which the recipe's `[model]`
    rebuilds (`train_state.json` records that section as `base_model`); full fine-tuning freezes
    nothing, so its checkpoints hold every weight, as before."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state of what trains (`_trained_only`). A QLoRA base's 4-bit weights are
    frozen, but bitsandbytes' quantisation state beside them (`weight.absmax`, ...) is no parameter
    that `ignore_frozen_params` knows: it is left out here, as the rest of the base."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hpref.models.quantize import quantized_state_keys

    model_state, optim_state = get_state_dict(model, optimizer, options=_trained_only())
    for key in quantized_state_keys(model, list(model_state)):
        del model_state[key]
    return model_state, optim_state


@dataclass
class Restored:
    path: Path
    train_state: dict[str, Any]
    rank_state: dict[str, Any] = field(default_factory=dict)  # this rank's `rank_state`, if saved


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object; the checkpoint is damaged")
    return data


def load_checkpoint(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path | None = None
) -> Restored:
    """Collective: load model, optimizer and this rank's RNG from a complete checkpoint in place,
    after its files verify against their checksums. With `run_dir` (a resume), a checkpoint of that
    run becomes what its `latest` names: the timeline the run continues (`continue_timeline`)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rank, world = _rank_and_world()
    path = Path(path)
    if path not in _VERIFIED:
        problems = _problems(path)
        if problems:
            raise CheckpointError(f"checkpoint does not verify: {problems[0]}")
    train_state = _read_json(path / TRAIN_STATE)
    for key in ("step", "world_size", "sampler", "scheduler"):
        if key not in train_state:
            raise CheckpointError(f"{path / TRAIN_STATE}: no '{key}'; the checkpoint is damaged")
    if train_state.get("world_size") != world:
        raise UserError(
            f"checkpoint {path} was written by {train_state.get('world_size')} ranks, this run has {world}; "
            "resume with the same number of processes"
        )
    model_state, optim_state = _trained_state(model, optimizer)
    dcp_load(checkpoint_layout(model, model_state, optim_state), path)  # in place: views share storage
    state = {"model": model_state, "optim": optim_state}
    # frozen weights (a LoRA base) are not in the checkpoint: the model already holds them
    frozen = any(not p.requires_grad for p in model.parameters())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_trained_only(strict=not frozen),
    )
    rank_file = path / _rank_file(rank)
    rank_state = _read_json(rank_file)
    try:
        set_rng_state(rank_state["rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{rank_file}: unusable RNG state ({type(exc).__name__}: {exc})") from None
    if run_dir is not None:
        continue_timeline(run_dir, path)
    logger.info(f"resumed from {path} (step {train_state['step']})")
    own = {k: v for k, v in rank_state.items() if k not in ("rank", "rng")}
    return Restored(path=path, train_state=train_state, rank_state=own)


def continue_timeline(run_dir: Path, path: Path) -> None:
    """Rank 0, on resume: point `latest` at the checkpoint the run continues from, so that its next
    save descends from it (`hpref.runfolder.lineage`). After an explicit resume from an older
    checkpoint, the newer ones are then an abandoned timeline that `--resume auto` never picks; after
    an auto resume past a `latest` whose write failed, the pointer is right again. A checkpoint of
    another run folder leaves this run's pointer alone."""
    root = Path(run_dir) / CHECKPOINTS
    if _rank_and_world()[0] != 0 or Path(path).resolve().parent != root.resolve():
        return
    pointer = root / LATEST
    if pointer.is_file() and pointer.read_text().strip() == path.name:
        return
    write_text_atomic(pointer, path.name + "\n")
    logger.info(f"{pointer} -> {path.name}: the run continues from it")
