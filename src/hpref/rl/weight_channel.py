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

    One buffer is reused from bucket to bucket (the caller sends each before asking for the next),
    and each tensor goes into it as it arrives: a shard of an FSDP2 group is gathered straight into
    its place in the buffer (`_gather_into`; every rank of the group runs this with the same items
    and keeps a buffer of its own), a plain tensor is copied in, cast on the way. A sync so holds one
    buffer beyond the model. A tensor larger than a bucket goes alone: as itself when it is already
    in `dtype`, contiguous and on `device` (no copy at all), else in a buffer of its own size."""
    import math

    import torch
    from torch.distributed.tensor import DTensor

    capacity = max(bucket_bytes // torch.empty((), dtype=dtype).element_size(), 1)
    buffer: torch.Tensor | None = None
    layout: Layout = []
    used = 0
    for name, tensor in items:
        size = math.prod(tensor.shape)
        room = _gathered_size(tensor) if isinstance(tensor, DTensor) else size
        if room > capacity:
            if layout:
                yield layout, buffer[:used]
                layout, used = [], 0
            if isinstance(tensor, DTensor):
                alone = torch.empty(room, dtype=dtype, device=device)
                _fill(alone, tensor)
                alone = alone[:size]
            else:
                alone = tensor.detach().to(device=device, dtype=dtype).contiguous().view(-1)
            yield [(name, tuple(tensor.shape))], alone
            continue
        if used + room > capacity:
            yield layout, buffer[:used]
            layout, used = [], 0
        if buffer is None:
            buffer = torch.empty(capacity, dtype=dtype, device=device)
        _fill(buffer[used : used + room], tensor)
        layout.append((name, tuple(tensor.shape)))
        used += size
    if layout:
        yield layout, buffer[:used]


def _fill(region: torch.Tensor, tensor: torch.Tensor) -> None:
    """`tensor`'s values, flattened, at the start of `region` (a shard: gathered into it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        region[: tensor.numel()].copy_(tensor.detach().reshape(-1))
    elif _dim0_sharded(tensor) and tensor.dtype == region.dtype and tensor.device == region.device:
        _gather_into(region, tensor)
    else:  # another placement, a cast or another device: gathered whole first (one tensor's temporary)
        region[: tensor.numel()].copy_(tensor.full_tensor().reshape(-1))


def _dim0_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import Shard

    return tuple(tensor.placements) == (Shard(0),) and tensor.dim() >= 1


def _gathered_size(tensor: Any) -> int:
    """Elements an all-gather of FSDP2's dim-0 shards writes: every rank's shard padded to the
    largest (`ceil(rows / ranks)` rows), so a little more than the tensor."""
    import math

    if not _dim0_sharded(tensor):
        return math.prod(tensor.shape)
    ranks = tensor.device_mesh.size()
    rows = tensor.shape[0]
    per_row = math.prod(tensor.shape[1:])
    return -(-rows // ranks) * ranks * per_row


def _gather_into(region: torch.Tensor, tensor: Any) -> None:
    """All-gather FSDP2's dim-0 shards of `tensor` into `region`. FSDP2 cuts rows as `torch.chunk`
    does (ceil(rows / ranks) each, the last ranks short or empty), so with every shard padded to
    that many rows the gathered rows are the tensor's in order, padding only at the end: the
    tensor is the first `numel` elements of the region, with no copy after the gather."""
    import torch
    import torch.distributed as dist

    ranks = tensor.device_mesh.size()
    chunk = -(-tensor.shape[0] // ranks)
    local = tensor.to_local().detach()
    padded = local
    if local.shape[0] != chunk:  # a short (or empty) last shard: padded to the common size
        padded = torch.zeros((chunk, *tensor.shape[1:]), dtype=local.dtype, device=local.device)
        padded[: local.shape[0]].copy_(local)
    out = region[: chunk * ranks * padded[0].numel()].view(chunk * ranks, *tensor.shape[1:])
    dist.all_gather_into_tensor(out, padded.contiguous(), group=tensor.device_mesh.get_group())
