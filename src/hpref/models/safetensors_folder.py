"""A transformers folder's `*.safetensors` weights as a mapping that reads each tensor when asked.

Converting a checkpoint into another layout (the megatron backend's fused, tensor-parallel shards)
needs every tensor once, in turn. Reading the whole folder first holds the full checkpoint in memory
beside the model being built, on every rank; reading tensor by tensor (`safe_open`, memory-mapped)
holds one source tensor at a time, so a rank's peak is its own shard of the model plus the largest
single tensor, whatever the model's size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch


class SafetensorsFolder(Mapping[str, torch.Tensor]):
    """The tensors of `files` by name, each read from its file on access (a fresh CPU tensor)."""

    def __init__(self, files: Sequence[Path]):
        from safetensors import safe_open

        self._file_of: dict[str, str] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (the handle is not iterable)
                    self._file_of[key] = str(file)

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file_of[key], framework="pt") as handle:
            return handle.get_tensor(key)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)
