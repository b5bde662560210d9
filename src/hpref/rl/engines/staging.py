"""An open weight update's tensors, held in a temporary file until the update commits or aborts.

A sync arrives in buckets (`hpref.rl.transport.weight_channel`) and must not reach the weights that
serve until every name has come and been checked (`VersionedWeights.commit_update`): a transfer cut
half-way leaves the old version serving. Held in memory, the staged buckets were a second copy of
the whole model in the engine's process (540 MB more for SmolLM2 in fp32, and on a GPU engine in GPU
memory, where vLLM's KV cache wants it). Here each bucket is written to the stage's file as it
arrives, so the engine holds one bucket beyond its model while the rest comes; at the commit the
engine's loader reads the stage back one tensor at a time (`StagedState`, a mapping that reads a
tensor from the file when asked for it), so the swap holds one tensor beyond the model. The bytes
pass through the page cache, which the kernel can drop, never the process's own memory. The file
is unlinked as soon as it is opened: a killed engine leaves nothing on disk.

An engine whose model lives in other processes (vLLM at tensor parallel > 1: its worker processes)
hands them the stage's `handle()`, a path to the open file (`/proc/<pid>/fd/<n>` on Linux: the file
has no name of its own) and the entries, and each worker reads the tensors from the file one at a
time (`StageHandle.opened`): no process holds the whole state, where serialising it for every worker
held it in the engine and once more in each worker.

`HPREF_STAGE_DIR` (else the system's temporary folder) says where the files go: it needs room for one
model in the engine's dtype per engine syncing at once.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: where stage files go (default: `tempfile.gettempdir()`)
STAGE_DIR_ENV = "HPREF_STAGE_DIR"

#: each tensor starts at a multiple of this many bytes in the file (a read lands whole pages)
ALIGN = 64

#: a staged tensor's place in the file: (offset, shape, dtype)
Entry = tuple[int, tuple[int, ...], "torch.dtype"]


class StagedUpdate:
    """The tensors of one open update (a version of the whole model, or of one adapter): `add`
    writes a part, `meta()` gives each staged name a shape-and-dtype stand-in (a `meta` tensor: no
    data) for the whole-state check, `state()` the staged values as a mapping read from the file
    on demand, `close()` drops it all. A name staged twice keeps its last value."""

    def __init__(self, version: int) -> None:
        self.version = version
        fd, path = tempfile.mkstemp(
            prefix="hpref-weights-", suffix=".stage", dir=os.environ.get(STAGE_DIR_ENV)
        )
        self._file = os.fdopen(fd, "rb+", buffering=0)
        self._owned: str | None = path
        if sys.platform.startswith("linux"):  # the open file stays readable: the name can go at once
            os.unlink(path)
            self._owned = None
        self.entries: dict[str, Entry] = {}
        self.size = 0

    def add(self, state: dict[str, Any]) -> None:
        """Write `state`'s tensors (any device) to the file; nothing of them is kept."""
        import torch

        for name, tensor in state.items():
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            offset = -(-self.size // ALIGN) * ALIGN
            if flat.numel():
                self._file.seek(offset)
                self._file.write(memoryview(flat.view(torch.uint8).numpy()))
                self.size = offset + flat.numel() * flat.element_size()
            self.entries[name] = (offset, tuple(tensor.shape), tensor.dtype)

    def meta(self) -> dict[str, torch.Tensor]:
        """Each staged name's shape and dtype, as a tensor on the `meta` device (no data)."""
        import torch

        return {
            n: torch.empty(shape, dtype=dtype, device="meta") for n, (_, shape, dtype) in self.entries.items()
        }

    def read(self, name: str) -> torch.Tensor:
        """The staged value of `name`, read into a tensor of its own."""
        return _read(self._file, name, self.entries[name])

    def state(self) -> StagedState:
        return StagedState(self._file, self.entries, self)

    def handle(self) -> StageHandle:
        """What another process on this machine needs to read the stage (see the module docstring);
        valid until the stage is closed."""
        self._file.flush()
        path = f"/proc/{os.getpid()}/fd/{self._file.fileno()}" if self._owned is None else self._owned
        return StageHandle(path, dict(self.entries))

    def close(self) -> None:
        self._file.close()
        if self._owned is not None:
            os.unlink(self._owned)
            self._owned = None


class StagedState(Mapping):
    """A commit's state dict: the staged names, each tensor read from the stage when it is asked
    for and not kept, so a loader that copies tensor by tensor (both built-in engines) holds one
    at a time. Valid until the stage is closed. `stage`: the `StagedUpdate` it reads, in the
    engine's process (None in a process that opened a `StageHandle`)."""

    def __init__(self, file: IO[bytes], entries: dict[str, Entry], stage: StagedUpdate | None = None) -> None:
        self._file, self._entries, self.stage = file, entries, stage

    def __getitem__(self, name: str) -> torch.Tensor:
        return _read(self._file, name, self._entries[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class StageHandle:
    """A stage as another process reads it: the path to its open file and its entries (small: what
    an RPC to vLLM's worker processes carries instead of the tensors, as `wire()`'s plain values,
    since vLLM's RPC encodes msgpack, which knows no `torch.dtype`)."""

    path: str
    entries: dict[str, Entry]

    def wire(self) -> tuple[str, dict[str, tuple[int, list[int], str]]]:
        """(path, entries) in strings, ints and lists: `from_wire` rebuilds the handle."""
        return self.path, {
            n: (offset, list(shape), str(dtype).removeprefix("torch."))
            for n, (offset, shape, dtype) in self.entries.items()
        }

    @classmethod
    def from_wire(cls, path: str, entries: dict[str, Any]) -> StageHandle:
        import torch

        return cls(
            path,
            {n: (int(o), tuple(shape), getattr(torch, dtype)) for n, (o, shape, dtype) in entries.items()},
        )

    @contextmanager
    def opened(self) -> Iterator[StagedState]:
        """The stage's state, read from the file tensor by tensor, while the block runs."""
        with open(self.path, "rb", buffering=0) as file:
            yield StagedState(file, self.entries)


def _read(file: IO[bytes], name: str, entry: Entry) -> torch.Tensor:
    """The tensor `entry` places in `file`, read into a tensor of its own."""
    import torch

    offset, shape, dtype = entry
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        file.seek(offset)
        done = 0
        while done < len(view):  # a read may stop short of what was asked
            got = file.readinto(view[done:])
            if not got:
                raise OSError(f"the weight stage ended {len(view) - done} bytes short in '{name}'")
            done += got
    return out
