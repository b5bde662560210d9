"""Training checkpoints: torch.distributed.checkpoint (DCP) for the tensors, JSON for the rest.

Layout of a run folder's `checkpoints/`:

    step-000040/          a complete checkpoint (only ever created by a rename)
      .metadata, *.distcp   DCP: model and optimizer, sharded as they were trained
      train_state.json      step, sampler position, scheduler, world size (identical on every rank)
      rank-00000.json       that rank's RNG states (CPU, CUDA, Python, NumPy)
    .tmp-step-000050/     being written, or left behind by a crash: never loaded
    latest                the name of the newest complete checkpoint (replaced atomically)

Why this shape
- A checkpoint is written to `.tmp-step-N` and renamed to `step-N` by rank 0 after a barrier, so a
  folder named `step-N` is complete by construction; a crash mid-save leaves only a `.tmp-*`.
- Nothing arbitrary is unpickled on load: the small state is JSON, DCP's tensor files hold raw
  bytes (non-tensor items go through `torch.load(weights_only=True)`), and DCP's `.metadata`, a
  pickle, is read by `SafeFileSystemReader`, whose unpickler admits only DCP's own metadata classes,
  torch sizes/dtypes/layouts and paths.
- RNG state is per rank (dropout draws differ by rank), so each rank saves and reloads its own file;
  resuming with a different world size is refused rather than silently changing the run.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from loguru import logger

from hpref.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRAIN_STATE = "train_state.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def _is_complete(folder: Path) -> bool:
    return (folder / ".metadata").is_file() and (folder / TRAIN_STATE).is_file()


def _step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step-"))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and _is_complete(p)]
    return sorted(found, key=_step_of)


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None. Partial ones (`.tmp-*`, or a `step-*` folder missing
    its metadata) are ignored with a warning; a `latest` pointer to a missing folder is not trusted."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    for p in sorted(root.iterdir()):
        if p.is_dir() and (
            p.name.startswith(TMP_PREFIX) or (p.name.startswith("step-") and not _is_complete(p))
        ):
            logger.warning(f"ignoring partial checkpoint {p} (a save that did not finish)")
    complete = complete_checkpoints(run_dir)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in complete:
            return named
        logger.warning(
            f"{pointer} names '{named.name}', which is not a complete checkpoint; scanning instead"
        )
    return complete[-1] if complete else None


def resolve_resume(run_dir: Path, resume: str | Path | None) -> Path | None:
    """`--resume auto` -> the latest complete checkpoint (None for a fresh run); a path -> that
    checkpoint, which must be complete."""
    if resume is None:
        return None
    if str(resume) == "auto":
        found = find_latest(run_dir)
        if found is None:
            logger.info(
                f"--resume auto: no complete checkpoint under {Path(run_dir) / CHECKPOINTS}; starting fresh"
            )
        return found
    path = Path(resume)
    if path.is_dir() and not _is_complete(path) and (path / CHECKPOINTS).is_dir():
        found = find_latest(path)  # a run folder
        if found is None:
            raise UserError(f"--resume {path}: the run folder has no complete checkpoint")
        return found
    if not path.is_dir() or not _is_complete(path):
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
# reading DCP metadata without arbitrary pickle


class UnsafeCheckpointError(UserError):
    """A checkpoint's metadata names something other than checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes DCP writes into `.metadata` and nothing else."""

    _DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
    _EXACT = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._EXACT or module in self._DCP_MODULES:
            found = super().find_class(module, name)
            if module not in self._DCP_MODULES or isinstance(found, type):
                return found
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
                return value
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not checkpoint metadata; "
            "refusing to load it (was the file replaced?)"
        )


def _safe_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """`FileSystemReader` whose `read_metadata` uses the allow-list unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(metadata_path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(path))


# --------------------------------------------------------------------------------------------------
# save / load


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_json(path: Path, data: Any) -> None:
    _write_atomically(path, json.dumps(data))


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    keep: int,
) -> Path:
    """Collective: every rank calls it. Returns the final `step-N` folder."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = _rank_and_world()
    root = Path(run_dir) / CHECKPOINTS
    final = root / checkpoint_name(step)
    tmp = root / f"{TMP_PREFIX}{checkpoint_name(step)}"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    _write_json(tmp / _rank_file(rank), {"rank": rank, "rng": rng_state()})
    if rank == 0:
        _write_json(tmp / TRAIN_STATE, {**train_state, "step": step, "world_size": world})
    _barrier()
    if rank == 0:
        if final.exists():  # the same step saved twice (an interval that is also an epoch end)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomically(root / LATEST, final.name + "\n")
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info(f"checkpoint {final}")
    _barrier()
    return final


@dataclass
class Restored:
    path: Path
    train_state: dict[str, Any]


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Restored:
    """Collective: load model, optimizer and this rank's RNG from a complete checkpoint in place."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = _rank_and_world()
    path = Path(path)
    train_state = json.loads((path / TRAIN_STATE).read_text())
    if train_state.get("world_size") != world:
        raise UserError(
            f"checkpoint {path} was written by {train_state.get('world_size')} ranks, this run has {world}; "
            "resume with the same number of processes"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    load(state, storage_reader=_safe_reader(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank_state = json.loads((path / _rank_file(rank)).read_text())
    set_rng_state(rank_state["rng"])
    logger.info(f"resumed from {path} (step {train_state['step']})")
    return Restored(path=path, train_state=train_state)
