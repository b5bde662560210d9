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

`HPREF_STAGE_DIR` (else the system's temporary folder) says where the files go: it needs room for one
model in the engine's dtype per engine syncing at once.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: where stage files go (default: `tempfile.gettempdir()`)
STAGE_DIR_ENV = "HPREF_STAGE_DIR"

#: each tensor starts at a multiple of this many bytes in the file (a read lands whole pages)
ALIGN = 64


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
        self.entries: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
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
        import torch

        offset, shape, dtype = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            self._file.seek(offset)
            done = 0
            while done < len(view):  # a read may stop short of what was asked
                got = self._file.readinto(view[done:])
                if not got:
                    raise OSError(f"the weight stage ended {len(view) - done} bytes short in '{name}'")
                done += got
        return out

    def state(self) -> StagedState:
        return StagedState(self)

    def close(self) -> None:
        self._file.close()
        if self._owned is not None:
            os.unlink(self._owned)
            self._owned = None


class StagedState(Mapping):
    """A commit's state dict: the staged names, each tensor read from the stage when it is asked
    for and not kept, so a loader that copies tensor by tensor (both built-in engines) holds one
    at a time. Valid until the stage is closed."""

    def __init__(self, stage: StagedUpdate) -> None:
        self._stage = stage

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._stage.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._stage.entries)

    def __len__(self) -> int:
        return len(self._stage.entries)
