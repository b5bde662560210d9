"""Starting or joining the Ray cluster `hpref rl` runs its actors on and `hpref serve` deploys to,
listening on loopback only.

A local cluster is started addressed as 127.0.0.1 (Ray's default listens on every interface and
runs any code sent to it); a cluster given by `--ray-address` is joined with the token Ray finds,
and one that cannot be reached, or refuses the token, is a one-line `UserError`.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from contextlib import contextmanager
from typing import Any

from hpref.errors import UserError
from hpref.runtime.stores import LOOPBACK_HOSTS

#: Ray resolves a node address of 127.0.0.1 to the machine's network address (so that other nodes
#: could reach it) unless this is 0, and its GCS, raylet and workers listen on every interface
#: unless the node address is exactly 127.0.0.1. One switch gives a cluster that listens on loopback.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextmanager
def _loopback_ray():
    """Ray on this node addressed (and listening) as 127.0.0.1, for a `ray.init` in the block.

    The switch is read from the environment when Ray's constants are first imported, and the GCS
    and raylet this process starts inherit it; a Ray imported before us has read it already, so its
    constant is set for the block too.
    """
    import ray._private.ray_constants as ray_constants

    old_env, old_flag = os.environ.get(RAY_LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[RAY_LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(RAY_LOOPBACK_ENV, None)
        else:
            os.environ[RAY_LOOPBACK_ENV] = old_env


@contextmanager
def _own_sigterm():
    """Around a `ray.init`: a caller that handles SIGTERM itself (`hpref rl`'s graceful stop) keeps
    its handler. `ray.init` sets its own in the driver as it starts (`sys.exit(15)`) and its core
    worker a C++ one as it connects (a stack dump, then an abort); the caller's is put back after,
    and a SIGTERM that arrives while Ray starts reaches it instead of Ray's exit. A caller without
    one (SIGTERM's default action) gets Ray's behaviour, as before."""
    own = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if not callable(own):
        yield
        return
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:  # Ray's handler exits with the signal's number
            raise
        signal.signal(signal.SIGTERM, own)
        own(signal.SIGTERM, None)  # the caller's answer: `hpref rl` raises its StopNow here
        raise
    finally:
        signal.signal(signal.SIGTERM, own)


def connect_ray(address: str | None, *, metrics_report_ms: int | None = None) -> bool:
    """Start a local Ray cluster listening on loopback only, or join the one at `address`.

    Returns whether this call connected (False: Ray was already initialised in this process, whose
    owner shuts it down). Joining: a cluster started with token authentication (Ray's default when
    `~/.ray/auth_token` exists) gets the token Ray finds (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`,
    `~/.ray/auth_token`); Ray itself only does this for address "auto". A loopback address is joined
    as a loopback node, which is what a head started on loopback (README) expects. A cluster that
    cannot be reached, or refuses the token, is a `UserError`. `metrics_report_ms`: how often a local
    cluster's processes report their metrics to the node's exporter (Ray's default: 10 s). The
    caller's own SIGTERM handler, if it has one, is still in place after (`_own_sigterm`).
    """
    import ray

    from hpref.logs import route_library_logs, stderr_to_log

    route_library_logs()  # "Started a local Ray instance", token notes: the log file, not the console
    if ray.is_initialized():
        return False
    if not address:
        with _loopback_ray(), _own_sigterm():
            system = {"metrics_report_interval_ms": metrics_report_ms} if metrics_report_ms else None
            ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, _system_config=system)
        return True
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise UserError(
            f"--ray-address {address}: expected HOST:PORT of a Ray head (ray start --head --port)"
        )
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise UserError(
            f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}); start one "
            "with `ray start --head` (see README) or leave --ray-address out for a local one"
        ) from None
    try:
        # Ray's C++ client retries a refused token or a missing head once a second for ~20 s and
        # warns on fd 2 each time (RAY_BACKEND_LOG_LEVEL does not reach it): twenty lines ahead of
        # the one that says what is wrong
        with stderr_to_log("ray.init"), _own_sigterm():
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
            if host in LOOPBACK_HOSTS:
                with _loopback_ray():
                    ray.init(address=address, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as exc:
        raise UserError(
            f"--ray-address {address}: could not join the Ray cluster: {str(exc).splitlines()[0]}; "
            "if it uses token authentication, give this process the same token (RAY_AUTH_TOKEN or "
            "~/.ray/auth_token); a head on this machine must be started as the README says "
            "(its node address 127.0.0.1)"
        ) from None
    return True


# --------------------------------------------------------------------------------------------------
# naming an actor that died


def ray_cause(exc: BaseException) -> BaseException:
    """The user's error inside a Ray task error (Ray wraps the actor's exception), also when it was
    raised by an actor's constructor: Ray then answers every call with an `ActorDiedError` that
    carries the creation task's error as its argument (a trainer rank refusing a GPU it cannot see)."""
    from ray.exceptions import ActorDiedError, RayTaskError

    if isinstance(exc, ActorDiedError) and exc.args and isinstance(exc.args[0], RayTaskError):
        exc = exc.args[0]
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def actor_names(handles: Any) -> dict[str, str]:
    """Ray actor id (hex) -> what it is, for naming an actor that died."""
    names = {}
    hosted = False
    executor = getattr(handles.executor, "_actor_id", None)  # None: in the driver, no actor
    for p, engine in handles.engines.items():
        engine_id = getattr(engine, "_actor_id", None)
        if engine_id is None or engine_id == executor:  # in the executor's process (`HostedEngine`)
            hosted = True
            continue
        names[engine_id.hex()] = f"policy '{p}': engine actor"
    for p, group in handles.trainers.items():
        for rank, trainer in enumerate(group.ranks):
            what = "trainer actor" if len(group.ranks) == 1 else f"trainer rank {rank} actor"
            names[trainer._actor_id.hex()] = f"policy '{p}': {what}"
    if executor is not None:
        engines = ", hosting the engines" if hosted else ""
        names[executor.hex()] = f"the rollout executor actor (shared by all policies{engines})"
    return names


def actor_death(exc: BaseException | None) -> BaseException | None:
    """The `RayActorError` (a dead or unreachable actor) in `exc`'s chain of Ray wrappers, if any.

    The innermost one is the actor that actually died: an engine killed under the executor reaches
    the driver as the executor's task error wrapping the engine's death.
    """
    from ray.exceptions import RayActorError

    found = None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RayActorError) and getattr(exc, "actor_id", None):
            found = exc
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return found


def dead_actor(handles: Any, names: dict[str, str], timeout_s: float = 15.0) -> str | None:
    """The first of the run's actors that is dead, asked directly: for an error that does not say
    which actor died (a weight push cut by a trainer's death reaches the driver as gloo's "connection
    reset by peer"). An actor that only answers slowly is not dead."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    ranks = [rank for group in handles.trainers.values() for rank in group.ranks]
    for actor in [*ranks, *handles.engines.values(), handles.executor]:
        if getattr(actor, "_actor_id", None) is None:  # in the driver's process: not an actor
            continue
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except RayActorError:
            return names.get(actor._actor_id.hex(), f"Ray actor {actor._actor_id.hex()}")
        except GetTimeoutError:
            continue
    return None


def lost_actor(exc: BaseException, names: dict[str, str]) -> str | None:
    """`policy 'b': trainer actor` when `exc` says one of this run's actors died, else None."""
    death = actor_death(exc)
    if death is None:
        return None
    return names.get(death.actor_id, f"Ray actor {death.actor_id}")
