"""Process groups: one rank's place in a run (`DistInfo`), the group it joins and its seeds.

`init_distributed` is the one place a process group starts, for train workers and eval workers alike:
nccl on GPUs, gloo on CPU (or as the recipe says); a process started without torchrun's environment
gets a one-process group on an in-memory store, so the same code runs in-process.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from hpref.errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_distributed(backend: str, collective_timeout_s: float | None = None) -> DistInfo:
    """nccl on GPUs, gloo on CPU (or as the recipe says). Without torchrun's environment: a
    one-process group on an in-memory store. `collective_timeout_s` bounds how long a rank waits
    in one collective for a peer that never arrives (torch's default: 30 min for gloo)."""
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError("launch.backend = 'nccl' needs CUDA GPUs, and none is visible")
    backend = "nccl" if use_cuda else "gloo"
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    timeout = None if collective_timeout_s is None else timedelta(seconds=collective_timeout_s)
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, device_id=device if use_cuda else None, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistInfo(rank, world, local_rank, device, backend)


def seed_everything(seed: int, rank: int) -> None:
    """Global RNGs (dropout) differ by rank; data order and init use their own seeded generators."""
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
