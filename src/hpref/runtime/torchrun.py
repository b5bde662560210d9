"""torchrun in this process, for every command that starts ranks (`hpref train`, `hpref eval`).

More than one process starts through torchrun's own parser and launcher (`torch.distributed.run`,
the torchtune way), so every torchrun behaviour is there and a cluster needs nothing new. A rank that
fails stops the others (torchrun's agent watches them every 0.1 s) and `run_torchrun` reports which
rank died, with what, and where its log is; its exit code becomes `hpref`'s. A rank that stops
running without exiting is found by its heartbeat (`hpref.runtime.watchdog`), and every worker dies
with the launcher, even one killed with SIGKILL. A caller that stops gracefully on SIGTERM and Ctrl-C
(`hpref train`: `hpref.runtime.stop_signals`) keeps those signals from torchrun's agent.

A one-node run on the default endpoint listens on loopback only. torchrun's own stores bind every
interface whatever host they are given (`TCPStore` passes no address to bind(); both the libuv and
the legacy server), so the launcher hosts the rendezvous store itself on a socket it bound to
127.0.0.1 (`hpref.runtime.stores.bound_store`) through a static one-node rendezvous registered as
`hpref-loopback`; the workers reach it as clients (torchrun's shared agent store) and gloo is pinned
to the loopback interface. The printed command (`hpref train --dry-run`) is torchrun's standard c10d
launch, which run from a shell would listen on every interface. Several nodes, or an endpoint that is
not loopback, are the user's choice of network, and bind as torchrun does.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from hpref.recipe import LaunchSection
from hpref.runfolder.start import log_file
from hpref.runtime.stop_signals import TORCHRUN_SIGNALS, torchrun_environment
from hpref.runtime.stores import LOOPBACK_HOSTS, bound_store, gloo_loopback_environment

LOOPBACK_BACKEND = "hpref-loopback"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_handler(params):
    """torchrun rendezvous for one node whose store listens on loopback only (module docstring)."""
    import datetime

    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(params.endpoint, -1)
    timeout = int(params.config.get("timeout", 600))

    class LoopbackRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOOPBACK_BACKEND

    rendezvous = LoopbackRendezvous(host, port, 0, 1, params.run_id, timeout)
    # StaticTCPRendezvous creates its store (on every interface) only when it has none
    wait = datetime.timedelta(seconds=timeout)
    rendezvous._store = bound_store(host, port, 1, timeout=wait, multi_tenant=True)
    return rendezvous


def _register_loopback_backend() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _loopback_handler)


#: what a rank's collective raises when a peer process is gone (gloo's and NCCL's words): an echo of
#: another rank's failure, not a cause
PEER_LOST = ("closed by peer", "reset by peer", "remote worker", "remote process exited")


def _first_real_failure(exc: Any) -> tuple[int, Any]:
    """The rank whose failure explains the run: ranks whose error only says a peer went away come
    last (a failed or killed rank exits at once, and a peer blocked in a collective with it raises
    within the same second: error files keep whole seconds); before them, the earliest with an error
    of its own (exit code > 0, which carries a message), then ranks ended by a signal (torchrun's
    SIGTERM to the others, or a SIGKILL from outside: the OOM killer, kill -9)."""

    def peer_lost(failure: Any) -> bool:
        return any(words in str(failure.message).lower() for words in PEER_LOST)

    failures = sorted(
        exc.failures.items(),
        key=lambda item: (peer_lost(item[1]), item[1].exitcode <= 0, item[1].timestamp),
    )
    return failures[0] if failures else exc.get_first_failure()


@contextlib.contextmanager
def _quiet_torchrun():
    """torchrun's agent logs each failure on its own (warnings about SIGTERMs it sends, an error
    per failed rank, an OMP_NUM_THREADS banner): hpref reports a failure in one line naming the
    rank and its log, so the agent's loggers are raised to CRITICAL while it runs."""
    import logging

    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def run_torchrun(
    argv: list[str],
    run_dir: Path,
    launch: LaunchSection | None = None,
    env: dict[str, str] | None = None,
    *,
    handle_stop: bool = False,
) -> int:
    """torchrun in this process; a failed or stalled rank becomes one log line and an exit code.
    `env`: set for the workers (and restored here afterwards). `handle_stop`: the caller handles
    SIGTERM and SIGINT (`hpref.runtime.stop_signals`), so torchrun's agent must not; its `StopNow`
    passes through here after the agent has ended the workers."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from hpref.runtime.watchdog import Watchdog

    launch = launch or LaunchSection()
    logger.info(f"launching: torchrun {shlex.join(argv)}")
    args = parse_args(argv)
    env = dict(env or {})
    if handle_stop:
        # torchrun's `--signals-to-handle` (which its agent copies into the environment), and the
        # environment itself for a torch that reads only that
        args.signals_to_handle = TORCHRUN_SIGNALS
        env.update(torchrun_environment())
    host = args.rdzv_endpoint.rpartition(":")[0].strip("[]")
    if args.rdzv_backend == "c10d" and str(args.nnodes) == "1" and host in LOOPBACK_HOSTS:
        _register_loopback_backend()
        args.rdzv_backend = LOOPBACK_BACKEND
        env.update(gloo_loopback_environment())
    watchdog = None
    if launch.heartbeat_timeout_s > 0:
        watchdog = Watchdog(Path(tempfile.mkdtemp(prefix="hpref-heartbeat-")), launch.heartbeat_timeout_s)
        env.update(watchdog.environment())
    restore = set_environment(env)  # torchrun hands its environment to the workers
    try:
        if watchdog is not None:
            watchdog.start()
        with _quiet_torchrun():
            run(args)
    except ChildFailedError as exc:
        if watchdog is not None and watchdog.stall is not None:
            logger.error(watchdog.stall.message(run_dir))
            return 1
        rank, failure = _first_real_failure(exc)
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        what = f"exit code {failure.exitcode}" if failure.exitcode >= 0 else failure.signal_name()
        logger.error(f"rank {rank} failed ({what}): {message}; log: {log_file(run_dir, f'rank{rank}')}")
        others = sorted(r for r in exc.failures if r != rank)
        if others:
            logger.debug(f"stopped with it: rank(s) {', '.join(map(str, others))}")
        return failure.exitcode if failure.exitcode > 0 else 1
    except DistError as exc:
        # out of the agent itself, not a worker: the nodes' static rendezvous store never formed
        if args.rdzv_backend != "static":
            raise
        logger.error(_rendezvous_failure(args, exc))
        return 1
    finally:
        restore()
        if watchdog is not None:
            watchdog.stop()
            shutil.rmtree(watchdog.folder, ignore_errors=True)
    return 0


def set_environment(env: dict[str, str]) -> Callable[[], None]:
    """`env` into this process's environment (for the workers it starts, or an in-process worker);
    returns what puts the previous values back."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)

    def restore() -> None:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    return restore


def _rendezvous_failure(args: Any, exc: Exception) -> str:
    """One line for a rendezvous that never formed: which node, where, and what to check."""
    timeout = (args.rdzv_conf or "").partition("timeout=")[2].split(",")[0] or "900"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"node {args.node_rank} of {args.nnodes}: no rendezvous with the other node(s) at "
        f"{args.master_addr}:{args.master_port} within {timeout} s ({reason}); start every node with "
        "the same --nnodes and --rdzv-endpoint, or wait longer with --rdzv-timeout"
    )
