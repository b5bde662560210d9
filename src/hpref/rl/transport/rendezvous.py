"""How two or more Ray actors of a run find each other and form a torch process group: rank 0 of a
trainer group (or a weight channel's trainer end) serves a TCPStore on its node's address, the others
connect to it. Both the trainer's FSDP group (`hpref.rl.trainer.sharding`) and the trainer -> engine
weight channel (`hpref.rl.transport.weight_channel`) rendezvous here, so it sits below both.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: how long a rank waits in one collective for a peer that never arrives: a dead rank ends its
#: group's step in this time rather than torch's 30 minutes (the driver names the dead actor first)
COLLECTIVE_TIMEOUT_S = 300.0


def open_rendezvous(world_size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> tuple[Any, str, int]:
    """Rank 0's TCPStore for its group on a free port of this node's address, listening there only
    (`hpref.runtime.stores`): (store, host, port). The store lives as long as rank 0 keeps the
    object; the other ranks connect to (host, port)."""
    from hpref.runtime.stores import bound_store, pin_gloo_for

    host = _node_address()
    pin_gloo_for(host)
    store = bound_store(host, 0, world_size, timeout=timedelta(seconds=timeout_s))
    return store, host, int(store.port)


def _node_address() -> str:
    """This node's address as Ray knows it (loopback for a local cluster), else the host's name."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def join_group(store: Any, host: str, port: int, rank: int, world_size: int, device: torch.device) -> None:
    """Join the policy's process group: gloo on the CPU, NCCL on GPUs. `store`: rank 0's own store
    (`open_rendezvous`), None on the other ranks, which connect to (host, port)."""
    import torch.distributed as dist

    from hpref.runtime.stores import pin_gloo_for

    if store is None:
        pin_gloo_for(host)
        store = dist.TCPStore(host, port, world_size, is_master=False)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if device.type == "cuda" else None,
    )


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
