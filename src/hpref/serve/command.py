"""`hpref serve EXPORT`: check what the user asked for, start or join Ray, deploy, wait for Ctrl-C.

Everything a user can get wrong is checked before Ray starts (a one-line `UserError`, exit 2): the
export, the token file, the port (on this machine), replicas x threads against this machine's
cores, and that Ray Serve is installed. A local Ray cluster listens on loopback only
(`hpref.runtime.ray_cluster.connect_ray`, as `hpref rl` starts it); `--ray-address` joins a cluster,
whose nodes must have hpref installed, and then only this application is removed on exit.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from hpref.errors import UserError
from hpref.runtime.stores import LOOPBACK_HOSTS

SERVE_EXTRA = "pip install 'hpref[serve]'"


def read_token(path: Path | None) -> str | None:
    """The bearer token in `--token-file` (surrounding whitespace dropped), or None without one."""
    if path is None:
        return None
    try:
        token = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserError(f"--token-file {path}: cannot read it ({reason})") from None
    if not token:
        raise UserError(f"--token-file {path}: is empty; put the token clients will send in it")
    if any(c.isspace() for c in token):
        raise UserError(f"--token-file {path}: the token contains whitespace; use one word")
    return token


def check_port_free(host: str, port: int) -> None:
    """A clear error now rather than a Ray Serve proxy that retries binding forever."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UserError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); pick another port"
            ) from None


def _require_ray_serve() -> None:
    try:
        import fastapi  # noqa: F401
        import ray.serve  # noqa: F401
    except ImportError as exc:
        raise UserError(f"hpref serve needs Ray Serve ({exc.name} is missing): {SERVE_EXTRA}") from None


@dataclass(frozen=True)
class ServeRequest:
    """`hpref serve`'s options, built once by the CLI."""

    export: Path
    host: str = "127.0.0.1"
    port: int = 8000
    replicas: int = 1
    ray_address: str | None = None
    token_file: Path | None = None
    threads: int | None = None
    max_batch_size: int = 32
    precision: str = "auto"
    max_queued: int = 64
    request_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0


def serve_command(request: ServeRequest) -> int:
    """`hpref serve`: check the export and the options, then run the Ray Serve app until stopped."""
    from hpref.exports.layout import export_problem

    export, host, port, replicas = request.export, request.host, request.port, request.replicas
    ray_address, max_batch_size, precision = request.ray_address, request.max_batch_size, request.precision

    problem = export_problem(export)
    if problem:
        raise UserError(f"EXPORT: {problem}")
    token = read_token(request.token_file)
    cores = os.cpu_count() or 1
    threads = request.threads or max(1, cores // replicas)
    if ray_address is None:
        if replicas * threads > cores:
            raise UserError(
                f"--replicas {replicas} x --threads {threads} needs {replicas * threads} CPUs; this "
                f"machine has {cores} (lower either, or join a larger cluster with --ray-address)"
            )
        check_port_free(host, port)
    _require_ray_serve()
    if token is None and host not in LOOPBACK_HOSTS:
        logger.warning(f"listening on {host} without --token-file: anyone who reaches the port can use it")

    from ray import serve
    from ray.serve.config import BackpressureConfig

    from hpref.runtime.ray_cluster import connect_ray
    from hpref.serve.app import APP_NAME, RETRY_AFTER_S, HprefScorer, ServeSettings
    from hpref.serve.drain import drain, start_control
    from hpref.serve.metrics import METRICS_REPORT_MS

    settings = ServeSettings(
        export=str(Path(export).expanduser().resolve()),
        port=port,
        replicas=replicas,
        threads=threads,
        max_batch_size=max_batch_size,
        precision=precision,
        token=token,
        max_queued=request.max_queued,
        request_timeout_s=request.request_timeout_s,
        max_request_timeout_s=max(600.0, request.request_timeout_s),
        drain_timeout_s=request.drain_timeout_s,
    )
    # Ray Serve's proxy, controller and replicas log to Ray's serve log files, not the console: under
    # overload its proxy would print a line per shed request (the local cluster's processes inherit
    # this; hpref's own replica warnings still reach the console)
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    started = connect_ray(ray_address, metrics_report_ms=METRICS_REPORT_MS)
    _stop_on_sigterm()
    control = None
    try:
        control = start_control(port)
        serve.start(http_options={"host": host, "port": port})
        app = HprefScorer.options(
            num_replicas=replicas,
            ray_actor_options={"num_cpus": threads},
            # Ray Serve's default (5) would cap a replica's batch at 5 concurrent requests
            max_ongoing_requests=2 * max_batch_size,
            # the queue in front of the replicas (at the proxy) is bounded: past it, 503 at once with
            # Retry-After, not a wait that grows with the load (Ray's default is no bound)
            max_queued_requests=request.max_queued * replicas,
            backpressure_config=BackpressureConfig(status_code=503, retry_after_s=RETRY_AFTER_S),
            # what is in flight is answered before the stop (`hpref.serve.drain`): then Serve's
            # own shutdown has nothing left to wait for
            graceful_shutdown_wait_loop_s=0.5,
            graceful_shutdown_timeout_s=5,
            # one access-log line per request costs the replica and the driver CPU on a small
            # machine (the replica's errors are still logged)
            logging_config={"enable_access_log": False},
        ).bind(settings)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise UserError(f"the service did not start: {str(exc).splitlines()[0]}") from None
        shown = f"[{host}]" if ":" in host else host
        print(
            f"hpref serve: http://{shown}:{port} ({replicas} replica(s) of {export}); Ctrl-C stops",
            flush=True,
        )
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        limit = request.drain_timeout_s
        logger.info(f"stopping hpref serve: answering what is in flight (at most {limit:g} s)")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the drain short
        if control is not None:
            drain(control, request.drain_timeout_s, logger.warning)
    finally:
        _shutdown(serve, started, control)
    return 0


def _stop_on_sigterm() -> None:
    """SIGTERM (a service manager, `kill`) stops as Ctrl-C does: a drain, then the replicas and Ray."""

    def stop(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _shutdown(serve, started: bool, control) -> None:
    import ray

    if control is not None and not started:
        ray.kill(control)  # a shared cluster: the drain flag goes with this service
    try:
        if started:
            serve.shutdown()
        else:
            from hpref.serve.app import APP_NAME

            serve.delete(APP_NAME)  # a shared cluster keeps its other applications
    except Exception as exc:  # the cluster may already be gone; nothing left to stop then
        logger.debug(f"serve shutdown: {exc}")
    if started:
        ray.shutdown()
