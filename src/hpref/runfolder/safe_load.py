"""The one reader for files that may come from someone else: checkpoints, trainer state.

Why this exists. PyTorch's distributed checkpoint (DCP) keeps its index, `.metadata`, as a plain
pickle, and its default load planner reads non-tensor items (optimizer `param_groups`, ...) with
`torch.load(weights_only=False)`. Either runs arbitrary code from a tampered or downloaded
checkpoint. A pickle can name any importable global, and a name may be dotted
(`torch.distributed.checkpoint.metadata` + `os.system` walks into the `os` module that module
imports), so an allow-list must be exact `(module, name)` pairs, never module prefixes or "any
non-dunder name of this module".

Every path that reads a checkpoint (train resume, `hpref eval`, `hpref save`, rl resume) goes
through this module:

- `read_dcp_index(folder)`: the `.metadata` index, unpickled with `IndexUnpickler`, which admits
  only the exact classes DCP writes there (listed in `_INDEX_GLOBALS`), torch dtypes and layouts.
- `dcp_load(state, folder)`: DCP's load through a `FileSystemReader` that reads the index that way,
  and a load planner whose non-tensor items go through `load_torch_bytes`.
- `load_torch_bytes(data)` / `load_torch_file(path)`: `torch.load(weights_only=True)`, PyTorch's own
  restricted unpickler (tensors, containers and primitives only), with no extra globals admitted.

Any refusal or unreadable file is a `CheckpointError` (a `UserError`: one line, exit 2) naming the
file.
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import Any

from hpref.errors import UserError
from hpref.runfolder.layout import CHECKPOINT_INDEX


class CheckpointError(UserError):
    """A checkpoint that is missing, partial, corrupt, tampered with or does not fit the model."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file names code to run (a global outside the allow-list)."""


# Exactly what `torch.distributed.checkpoint` (torch 2.6-2.13) pickles into `.metadata`, found by
# recording `find_class` while reading real FSDP2 model+optimizer checkpoints (see
# tests/test_checkpoint_safety.py, which fails if a real checkpoint needs anything else).
_INDEX_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
    }
)


class IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index admitting only `_INDEX_GLOBALS` and torch dtypes/layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INDEX_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype | torch.layout):
                return value
        raise UnsafeCheckpointError(
            f"names {module}.{name}, which is not checkpoint metadata (refusing to run code from a "
            "checkpoint; was the file replaced?)"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def read_dcp_index(folder: str | Path) -> Any:
    """The DCP `Metadata` of a checkpoint folder, unpickled with the exact allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata

    index = Path(folder) / CHECKPOINT_INDEX
    try:
        data = index.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{index}: missing (not a DCP checkpoint, or a save that did not finish)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"{index}: cannot read it ({_first_line(exc)})") from None
    try:
        metadata = IndexUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{index}: {exc}") from None
    except Exception as exc:  # a damaged pickle raises anything: UnpicklingError, EOFError, ValueError
        raise CheckpointError(f"{index}: not a readable checkpoint index ({_first_line(exc)})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{index}: holds a {type(metadata).__name__}, not a DCP checkpoint index")
    return metadata


def load_torch_bytes(data: bytes | io.BytesIO, *, source: str | Path) -> Any:
    """`torch.load` of a stream that may come from a stranger: tensors, containers and primitives
    only (`weights_only=True`, no extra globals). `source` names the file in the error."""
    import torch

    stream = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only's refusal of a global is an UnpicklingError that names it
        raise UnsafeCheckpointError(f"{source}: refused to load ({_first_line(exc)})") from None
    except Exception as exc:
        raise CheckpointError(f"{source}: not a readable torch file ({_first_line(exc)})") from None


def load_torch_file(path: str | Path) -> Any:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({_first_line(exc)})") from None
    return load_torch_bytes(data, source=path)


def dcp_reader(folder: str | Path) -> Any:
    """A DCP `FileSystemReader` for `folder` whose index is read by `read_dcp_index`. Tensor items
    are read by DCP itself with `torch.load(weights_only=True)`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # per-rank indexes are a format hpref never writes
                raise CheckpointError(f"{folder}: per-rank DCP indexes are not supported")
            metadata = read_dcp_index(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(folder))


@functools.cache
def _planner_class() -> type:
    """DCP's default load planner, except that non-tensor items (which DCP reads with
    `torch.load(weights_only=False)`) go through `load_torch_bytes`. Built on first use so that
    importing this module does not import torch."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def __init__(self, folder: str | Path) -> None:
            super().__init__()
            self._folder = Path(folder)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            item = load_torch_bytes(value, source=self._folder / f"[{read_item.dest_index.fqn}]")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], item)
            else:
                self.state_dict[read_item.dest_index.fqn] = item

    return SafeLoadPlanner


def dcp_load(state: dict[str, Any], folder: str | Path, *, no_dist: bool = False) -> None:
    """`torch.distributed.checkpoint.load` into `state` in place, through the safe reader and
    planner; any failure (DCP raises `CheckpointException`, a `BaseException`) is one
    `CheckpointError` naming the folder and the first cause."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load(state, storage_reader=dcp_reader(folder), planner=_planner_class()(folder), no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        cause: BaseException = exc
        if isinstance(exc, CheckpointException) and exc.failures:
            cause = next(iter(exc.failures.values()))
            if isinstance(cause, tuple):  # (exception, traceback) in some torch versions
                cause = cause[0]
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from None
        raise CheckpointError(
            f"{folder}: cannot read the checkpoint's tensors ({_first_line(cause)}); it is corrupt"
        ) from None
