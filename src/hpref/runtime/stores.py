"""Rendezvous stores and gloo that listen where they are addressed, not on every interface.

torch's `TCPStore(host, port, is_master=True)` binds every interface whatever `host` says (neither
the libuv nor the legacy server passes an address to bind()), and gloo listens on the address of
the machine's hostname unless told an interface. Both carry the process group's trust: whoever
reaches the store can write into it, whoever reaches gloo can join collectives. So every store
hpref hosts is handed a socket already bound to its address (`TCPStore(master_listen_fd=...)`),
and a group whose peers meet on loopback pins gloo to the loopback interface. Used by the one-node
torchrun rendezvous (`hpref.runtime.torchrun`), a policy's trainer group and its weight channel to
the engine (`hpref.rl.trainer.sharding`, `hpref.rl.transport.weight_channel`).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def bound_store(
    host: str, port: int, world_size: int, *, timeout: timedelta, multi_tenant: bool = False
) -> Any:
    """The master `TCPStore` of a group, listening on `host`:`port` only (port 0: a free one; the
    store's is `store.port`). The store owns the listening socket and closes it when it goes."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(socket.SOMAXCONN)
    bound_port = listener.getsockname()[1]
    # detach: the store closes the descriptor itself; a Python socket object would close it again
    # when collected, by then perhaps another file's number
    return TCPStore(
        host,
        bound_port,
        world_size=world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=multi_tenant,
        master_listen_fd=listener.detach(),
    )


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def pin_gloo_for(host: str) -> None:
    """In this process, gloo groups whose peers meet at `host` listen on loopback when `host` is a
    loopback address (a local Ray cluster); elsewhere gloo keeps its choice (the hostname's address,
    or the user's GLOO_SOCKET_IFNAME), which other nodes must reach."""
    if is_loopback(host):
        os.environ.update(gloo_loopback_environment())


def gloo_loopback_environment() -> dict[str, str]:
    """The environment that pins gloo to the loopback interface ({} where the user chose one with
    GLOO_SOCKET_IFNAME, or the machine names none)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    return {"GLOO_SOCKET_IFNAME": loopback} if loopback else {}
