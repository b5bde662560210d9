"""A weight sync's bytes: trainer rank 0 -> its engine over a two-process group of their own (gloo
between CPUs, NCCL between GPUs), one flat buffer per bucket.

    trainer rank 0:  host, port = channel.open()        # serves the pair's TCPStore
    both at once:    connect(...)                       # rank 0 the trainer, rank 1 the engine
    per bucket:      the layout (names, shapes) goes through Ray, a few hundred bytes; the bytes go
                     through the channel: trainer `send(flat)`, engine `receive(layout)`

Why not Ray's object store, which carried whole state dicts before: an object that the engine
stages stays pinned in the store until the sync commits, so every bucket of a sync was resident at
once (a SmolLM2 sync with 64 MiB buckets added 1.1 GiB to the trainer's resident set, 18 buckets),
and pickling a tensor copies it once more on the way in. Here the trainer holds one bucket's
buffer, filled tensor by tensor (`pack_buckets`: a tensor is gathered from its shards, copied
into the buffer in the engine's dtype and dropped), and the engine one receive buffer per bucket,
which its staging keeps until the sync commits or aborts (`VersionedWeights`), as before.

The pair's group is not the default process group: the trainer rank 0 is already in its trainer
group's, so the channel builds a `ProcessGroupGloo` / `ProcessGroupNCCL` object directly from its
own store, as vLLM's weight-update examples do with their stateless groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: how long either side waits for the other in a bucket's transfer: a dead peer ends a sync in this
#: time (the driver names the dead actor first)
CHANNEL_TIMEOUT_S = 300.0

Layout = list[tuple[str, tuple[int, ...]]]


class WeightChannel:
    """One end of the trainer -> engine pair (rank 0: the trainer's rank 0, rank 1: the engine)."""

    def __init__(self, store: Any, rank: int, device: torch.device) -> None:
        import torch.distributed as dist

        self.rank, self.device = rank, device
        timeout = timedelta(seconds=CHANNEL_TIMEOUT_S)
        if device.type == "cuda":  # the GPU path (vLLM's NCCL weight update); not run on the CPU CI
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, 2, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, 2, timeout)

    def _broadcast(self, flat: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([flat], options).wait()

    def send(self, flat: torch.Tensor) -> None:
        self._broadcast(flat)

    def receive(self, layout: Layout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One bucket: a buffer of its size, filled by the trainer's broadcast, cut into its tensors
        (views of the buffer: nothing is copied again)."""
        import math

        import torch

        sizes = [math.prod(shape) for _name, shape in layout]
        flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
        self._broadcast(flat)
        out, offset = {}, 0
        for (name, shape), size in zip(layout, sizes, strict=True):
            out[name] = flat[offset : offset + size].view(shape)
            offset += size
        return out


def open_channel() -> tuple[Any, str, int]:
    """The trainer side's store for the pair: (store, host, port)."""
    from hpref.rl.sharding import open_rendezvous

    return open_rendezvous(2)


def connect(store: Any, host: str, port: int, rank: int, device: torch.device) -> WeightChannel:
    """Join the pair: rank 0 passes its own store, rank 1 connects to (host, port)."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=CHANNEL_TIMEOUT_S))
    return WeightChannel(dist.PrefixStore("hpref-weights", store), rank, device)


def pack_buckets(
    items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[Layout, torch.Tensor]]:
    """`items` as (layout, flat buffer) buckets of at most `bucket_bytes` in `dtype` on `device`.

    One buffer is reused from bucket to bucket (the caller sends each before asking for the next);
    each tensor is copied in as it arrives (cast on the way: no second copy), so the items' own
    temporaries (a tensor gathered from its shards) live one at a time. A tensor larger than a
    bucket goes alone, as itself when it is already in `dtype`, contiguous and on `device` (no
    copy at all), else as its cast copy."""
    import torch

    capacity = max(bucket_bytes // torch.empty((), dtype=dtype).element_size(), 1)
    buffer: torch.Tensor | None = None
    layout: Layout = []
    used = 0
    for name, tensor in items:
        size = tensor.numel()
        if size > capacity:
            if layout:
                yield layout, buffer[:used]
                layout, used = [], 0
            alone = tensor.detach().to(device=device, dtype=dtype).contiguous().view(-1)
            yield [(name, tuple(tensor.shape))], alone
            continue
        if used + size > capacity:
            yield layout, buffer[:used]
            layout, used = [], 0
        if buffer is None:
            buffer = torch.empty(capacity, dtype=dtype, device=device)
        buffer[used : used + size].copy_(tensor.detach().reshape(-1))
        layout.append((name, tuple(tensor.shape)))
        used += size
    if layout:
        yield layout, buffer[:used]
