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
    from hpref.rl.transport.rendezvous import open_rendezvous

    return open_rendezvous(2, CHANNEL_TIMEOUT_S)


def connect(store: Any, host: str, port: int, rank: int, device: torch.device) -> WeightChannel:
    """Join the pair: rank 0 passes its own store, rank 1 connects to (host, port)."""
    import torch.distributed as dist

    from hpref.runtime.stores import pin_gloo_for

    if store is None:
        pin_gloo_for(host)
        store = dist.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=CHANNEL_TIMEOUT_S))
    return WeightChannel(dist.PrefixStore("hpref-weights", store), rank, device)


def pack_buckets(
    items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[Layout, torch.Tensor]]:
    """`items` as (layout, flat buffer) buckets of at most `bucket_bytes` in `dtype` on `device`.

    One buffer is reused from bucket to bucket (the caller sends each before asking for the next),
    and each tensor goes into it as it arrives: a shard of an FSDP2 group is collected straight into
    its place in the buffer (`_collect`: the other ranks send their shards, see `send_shards`), a
    plain tensor is copied in, cast on the way. A sync so holds one buffer beyond the model. A
    tensor larger than a bucket goes alone: as itself when it is already in `dtype`, contiguous and
    on `device` (no copy at all), else in a buffer of its own size."""
    import math

    import torch
    from torch.distributed.tensor import DTensor

    capacity = max(bucket_bytes // torch.empty((), dtype=dtype).element_size(), 1)
    buffer: torch.Tensor | None = None
    layout: Layout = []
    used = 0
    for name, tensor in items:
        size = math.prod(tensor.shape)
        if size > capacity:
            if layout:
                yield layout, buffer[:used]
                layout, used = [], 0
            if isinstance(tensor, DTensor):
                alone = torch.empty(size, dtype=dtype, device=device)
                _fill(alone, tensor)
            else:
                alone = tensor.detach().to(device=device, dtype=dtype).contiguous().view(-1)
            yield [(name, tuple(tensor.shape))], alone
            continue
        if used + size > capacity:
            yield layout, buffer[:used]
            layout, used = [], 0
        if buffer is None:
            buffer = torch.empty(capacity, dtype=dtype, device=device)
        _fill(buffer[used : used + size], tensor)
        layout.append((name, tuple(tensor.shape)))
        used += size
    if layout:
        yield layout, buffer[:used]


def send_shards(items: Iterator[tuple[str, torch.Tensor]]) -> None:
    """What the group's other ranks run beside rank 0's `pack_buckets`: each FSDP2 shard they hold
    goes to rank 0 in the same order (`_collect`); whole tensors (LoRA's merged weights, gathered
    in `plain_items`) need nothing from them. They allocate nothing."""
    from torch.distributed.tensor import DTensor

    for _name, tensor in items:
        if isinstance(tensor, DTensor):
            if _dim0_sharded(tensor):
                _send_shard(tensor)
            else:
                tensor.full_tensor()  # another placement: the whole-tensor gather, joined


def _fill(region: torch.Tensor, tensor: torch.Tensor) -> None:
    """`tensor`'s values, flattened, into `region` (a shard's: collected from the group's ranks)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        region.copy_(tensor.detach().reshape(-1))
    elif _dim0_sharded(tensor):
        _collect(region, tensor)
    else:  # another placement: gathered whole first (one tensor's temporary)
        region.copy_(tensor.full_tensor().reshape(-1))


def _dim0_sharded(tensor: Any) -> bool:
    from torch.distributed.tensor import Shard

    return tuple(tensor.placements) == (Shard(0),) and tensor.dim() >= 1


def _rows(tensor: Any) -> list[int]:
    """How many rows of `tensor` each rank holds: FSDP2 cuts dim 0 as `torch.chunk` does
    (ceil(rows / ranks) each, the last ranks short or empty)."""
    ranks, rows = tensor.device_mesh.size(), tensor.shape[0]
    chunk = -(-rows // ranks)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(ranks)]


def _collect(region: torch.Tensor, tensor: Any) -> None:
    """Rank 0: its own shard copied, every other rank's received, each at its rows' place in
    `region`; shards are whole rows in order, so the region ends up the tensor, flattened, with
    nothing gathered anywhere else (received in the shard's dtype, then cast, when they differ)."""
    import math

    import torch.distributed as dist

    group = tensor.device_mesh.get_group()
    per_row = math.prod(tensor.shape[1:])
    start = 0
    for r, rows in enumerate(_rows(tensor)):
        size = rows * per_row
        if size == 0:
            continue
        place = region[start : start + size]
        if r == dist.get_rank(group):
            place.copy_(tensor.to_local().detach().reshape(-1))
        elif place.dtype == tensor.dtype and place.device == tensor.device:
            dist.recv(place, src=dist.get_global_rank(group, r), group=group)
        else:  # a cast (bf16 engine) or another device: one shard's temporary
            incoming = tensor.to_local().new_empty(size)
            dist.recv(incoming, src=dist.get_global_rank(group, r), group=group)
            place.copy_(incoming)
        start += size


def _send_shard(tensor: Any) -> None:
    import torch.distributed as dist

    local = tensor.to_local().detach()
    if local.numel():
        group = tensor.device_mesh.get_group()
        dist.send(local.contiguous().reshape(-1), dst=dist.get_global_rank(group, 0), group=group)
