"""The Ray Serve deployment behind `hpref serve`: one replica = one loaded export behind FastAPI.

Each replica loads the export once (`ExportScorer`), then every request is parsed and checked on the
replica's event loop (`hpref.serve.shapes`) into a scoring job, and jobs meet in `_run`, Ray Serve's
`@serve.batch`: the requests that arrive while a batch is being scored (up to `max_batch_size`, or
`batch_wait_s` after the first) are scored together in one packed pass, in the replica's scoring thread so the
loop keeps accepting the next batch (`shapes.score_jobs`: a request whose job fails fails alone).

Under load the service sheds instead of queueing without bound: each replica holds at most
`2 x max_batch_size` requests and `max_queued` more wait in front of it (Ray Serve's
`max_queued_requests`); past that a request is answered 503 with `Retry-After` at once. Each request
has a deadline (`X-Request-Timeout: SECONDS`, else `request_timeout_s`), counted from the moment a
replica takes it: past it the request is answered 504 and, if it has not been scored yet, its work
is dropped from the pass. `/metrics` is Prometheus text (`hpref.serve.metrics`).

`/health` answers when a replica does; `/ready` when every replica the deployment wants is running
(it says 503 while Ray Serve restarts a dead one). Both skip the bearer token, as load balancers'
probes send none; everything else needs it when `--token-file` was given.

Imported only by `hpref serve` (it imports Ray Serve and FastAPI at the top: Ray Serve's ingress
decorates the class when the module loads).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.exceptions import HTTPException

from hpref.serve import drain, metrics, shapes

if TYPE_CHECKING:
    from hpref.builtin.scoring import ExportScorer

APP_NAME = "hpref"
#: response header: requests scored in the same packed pass as this one (batching at work)
BATCH_HEADER = "X-Hpref-Batch-Size"
#: request header: the seconds the client will wait for this answer (else `request_timeout_s`)
TIMEOUT_HEADER = "X-Request-Timeout"
#: what a refused request's Retry-After says (shed at the queue, or the service stopping): about
#: one packed pass of a small model on a CPU
RETRY_AFTER_S = 1
DEPLOYMENT = "HprefScorer"
#: Ray Serve writes this logger to the replica's log file (stdlib: the ingress class is pickled by
#: value with what it refers to, and loguru's handlers hold open files)
logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ServeSettings:
    """Everything a replica needs, chosen by `hpref serve`'s options."""

    export: str
    port: int = 8000
    replicas: int = 1
    threads: int = 1
    max_batch_size: int = 32
    batch_wait_s: float = 0.005
    micro_batch_tokens: int = 16384
    #: the backbone's compute dtype (`hpref.models.precision`: auto = the one measured faster on this
    #: CPU, as `hpref train` picks); the head computes in fp32 whatever this is
    precision: str = "auto"
    token: str | None = field(default=None, repr=False)
    limits: shapes.Limits = field(default_factory=shapes.Limits)
    #: requests that may wait in front of each replica once it holds `2 x max_batch_size`
    max_queued: int = 64
    #: a request's deadline when it names none (`X-Request-Timeout`); the most it may name
    request_timeout_s: float = 60.0
    max_request_timeout_s: float = 600.0
    #: on SIGTERM, how long the requests in flight have to finish
    drain_timeout_s: float = 30.0


@dataclass(frozen=True)
class Timed:
    """A scoring job and the moment (`time.monotonic`) past which its answer is no use."""

    job: Any
    deadline: float


def request_deadline(request: Request, settings: ServeSettings, now: float) -> float:
    """`now` plus the request's `X-Request-Timeout` (seconds, > 0, at most the service's maximum),
    or the service's default; a value that is not a number is a 400."""
    given = request.headers.get(TIMEOUT_HEADER)
    if given is None:
        return now + settings.request_timeout_s
    try:
        seconds = float(given)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds <= settings.max_request_timeout_s:  # NaN fails this too
        most = settings.max_request_timeout_s
        raise shapes.BadRequest(400, f"{TIMEOUT_HEADER}: {given!r} is not seconds in (0, {most:g}]")
    return now + seconds


api = FastAPI(title="hpref serve", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(HTTPException)
async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    # unknown paths and methods answer in the same one-line shape as every other refusal
    return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)


def _error(status: int, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is longer than `limit`, declared or streamed."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise shapes.BadRequest(413, f"request body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise shapes.BadRequest(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def running_replicas() -> int:
    """Replicas of this deployment Ray Serve reports as running."""
    status = serve.status().applications.get(APP_NAME)
    deployment = status.deployments.get(DEPLOYMENT) if status is not None else None
    if deployment is None:
        return 0
    return int(sum(n for state, n in deployment.replica_states.items() if str(state).endswith("RUNNING")))


def export_info(settings: ServeSettings, scorer: ExportScorer) -> dict[str, Any]:
    """`/info`: what the export's model card and metadata say, and what this service accepts."""
    from hpref import __version__
    from hpref.exports.layout import MODEL_CARD, card_metrics

    meta = scorer.settings
    card = Path(settings.export) / MODEL_CARD
    return {
        "model": os.path.basename(os.path.normpath(settings.export)),
        "kind": scorer.kind,
        "head": meta.get("head", "judge"),
        "pooling": meta.get("pooling"),
        "formatter": getattr(scorer.formatter, "name", None),
        "max_length": getattr(scorer.formatter, "max_length", None),
        "labels": meta.get("labels", ["winner_model_a", "winner_model_b", "winner_tie"]),
        "tie_log_nu": meta.get("tie_log_nu"),
        "step": meta.get("step"),
        "dtype": meta.get("dtype"),
        "compute_dtype": str(scorer.compute_dtype or "torch.float32").removeprefix("torch."),
        "lora": meta.get("lora"),
        "metrics": card_metrics(card.read_text(encoding="utf-8")) if card.is_file() else {},
        "hpref_version": __version__,
        "endpoints": [
            "/v1/judge",
            "/v1/score",
            "/get_reward",
            "/remote_rm",
            "/info",
            "/health",
            "/ready",
            "/metrics",
        ],  # fmt: skip
        "replicas": settings.replicas,
        "max_batch_size": settings.max_batch_size,
        "max_queued": settings.max_queued,
        "request_timeout_s": settings.request_timeout_s,
        "limits": asdict(settings.limits),
    }


# the class last: Ray Serve pickles it (by value) when it is decorated, with the module's names
# defined so far
@serve.deployment(name=DEPLOYMENT, health_check_period_s=2.0, health_check_timeout_s=30.0)
@serve.ingress(api)
class HprefScorer:
    def __init__(self, settings: ServeSettings) -> None:
        import torch

        from hpref.builtin.scoring import ExportScorer
        from hpref.logs import hpref_home, route_library_logs, setup_logging
        from hpref.memory import (
            IDEEP_CACHE_ENV,
            ONEDNN_CACHE_ENV,
            PeriodicRelease,
            cap_ideep_cache,
            cap_onednn_cache,
        )

        # before the first matmul: oneDNN's and ideep's per-shape caches stay bounded. ideep's
        # (1,024 built matmuls by default) was what kept a replica's memory growing after its first
        # minute: each pass's new token count is a new shape, ~0.8 MiB more live native memory a
        # pass, 9 % from pass 25 to 80 (capped: 0 %; `benchmarks.serve_replica_memory`, figures in
        # benchmarks/README.md). /info reports the values set here.
        caches = {ONEDNN_CACHE_ENV: cap_onednn_cache(), IDEEP_CACHE_ENV: cap_ideep_cache()}

        # hpref's warnings on the replica's console; its DEBUG lines and the libraries' records
        # (transformers' load report, torch) in $HPREF_HOME/logs/serve-replica-<pid>.log
        log_file = hpref_home() / "logs" / f"serve-replica-{os.getpid()}.log"
        setup_logging(log_file, console=True, level="WARNING")
        route_library_logs()
        torch.set_num_threads(settings.threads)
        self.settings = settings
        self.scorer = ExportScorer.load(
            settings.export, micro_batch_tokens=settings.micro_batch_tokens, precision=settings.precision
        )
        self._run.set_max_batch_size(settings.max_batch_size)
        self._run.set_batch_wait_timeout_s(settings.batch_wait_s)
        self.info = {**export_info(settings, self.scorer), "native_caches": caches}
        self.metrics = metrics.ReplicaMetrics(settings.max_batch_size)
        # one scoring thread for the replica's life (torch's own threads do the parallel work), so
        # passes share one malloc arena instead of one per thread of asyncio's pool
        self.scoring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpref-scoring")
        self.release_memory = PeriodicRelease(1.0)
        self.drain = drain.ReplicaDrain(settings.port, lambda: self.metrics.held_now)
        # the first forward pays one-time costs (allocator, oneDNN kernels); not a client's request
        self.scorer.run([self.scorer.judge_job(("warm-up",), "a", "b", swap=False)])

    # ------------------------------------------------------------------------------------ plumbing
    def _authorized(self, request: Request) -> bool:
        """The bearer token, or the same token as `?token=` for clients that cannot send a header
        (OpenRLHF's and miles' post the URL they are given, nothing more)."""
        if self.settings.token is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.query_params.get("token", "")
        return hmac.compare_digest(given.strip().encode(), self.settings.token.encode())

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def _run(self, items: list[Timed]) -> list[tuple[Any, int]]:
        """Each job's result, and how many requests shared its packed pass (a response header). A
        job whose deadline has passed is not scored: its request has been answered 504 already."""
        now = time.monotonic()
        live = [i for i, item in enumerate(items) if item.deadline > now]
        self.metrics.scored(len(live), len(items) - len(live))
        results: list[Any] = [shapes.Failed(504, "deadline passed before it was scored")] * len(items)
        if live:
            jobs = [items[i].job for i in live]
            scored = await asyncio.get_running_loop().run_in_executor(self.scoring, self._score_pass, jobs)
            for i, result in zip(live, scored, strict=True):
                results[i] = result
        return [(result, len(live)) for result in results]

    def _score_pass(self, jobs: list[Any]) -> list[Any]:
        """One packed pass, in the scoring thread; then glibc hands back the pass's freed pages (at
        most once a second, `hpref.memory`): untrimmed, a replica's memory grew with every new mix
        of lengths it saw, by a third in four minutes of overload."""
        try:
            return shapes.score_jobs(self.scorer, jobs)
        finally:
            self.release_memory()

    async def _score(self, request: Request, parse: Any, deadline: float) -> JSONResponse:
        limits = self.settings.limits
        payload = shapes.decode_json(await read_body(request, limits.max_request_bytes), limits)
        job, respond = parse(payload, self.scorer, limits)
        result, batch = await self._run(Timed(job, deadline))
        if isinstance(result, shapes.Failed):
            return _error(result.status, result.message)
        return JSONResponse(respond(result), headers={BATCH_HEADER: str(batch)})

    async def _answer(self, request: Request, parse: Any) -> JSONResponse:
        started = time.monotonic()
        self.metrics.taken()
        status = 499  # nginx's "client closed request": only a cancelled request leaves without one
        try:
            reply = await self._checked(request, parse, started)
            status = reply.status_code
            return reply
        finally:
            self.metrics.answered(request.url.path, status, time.monotonic() - started)

    async def _checked(self, request: Request, parse: Any, started: float) -> JSONResponse:
        if self.drain.stopping:  # SIGTERM: what the replica holds is answered, nothing new taken
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return JSONResponse({"error": "the service is stopping; retry"}, status_code=503, headers=headers)
        try:
            if not self._authorized(request):
                return _error(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)")
            deadline = request_deadline(request, self.settings, started)
            return await asyncio.wait_for(self._score(request, parse, deadline), deadline - started)
        except shapes.BadRequest as exc:
            return _error(exc.status, exc.message)
        except TimeoutError:
            waited = time.monotonic() - started
            return _error(
                504, f"no answer within the request's deadline ({waited:.2f} s); its work was dropped"
            )
        except Exception as exc:  # never the replica: the client gets one line, the log the rest
            logger.exception("request failed")
            return _error(500, f"internal error: {type(exc).__name__}")

    # ------------------------------------------------------------------------------------ endpoints
    @api.post("/v1/judge")
    async def judge(self, request: Request) -> JSONResponse:
        return await self._answer(request, shapes.parse_judge)

    @api.post("/v1/score")
    async def score(self, request: Request) -> JSONResponse:
        return await self._answer(request, shapes.parse_score)

    @api.post("/get_reward")
    async def get_reward(self, request: Request) -> JSONResponse:
        return await self._answer(request, shapes.parse_get_reward)

    @api.post("/remote_rm")
    async def remote_rm(self, request: Request) -> JSONResponse:
        return await self._answer(request, shapes.parse_remote_rm)

    @api.get("/info")
    async def get_info(self, request: Request) -> JSONResponse:
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)")
        return JSONResponse(self.info)

    @api.get("/metrics")
    async def get_metrics(self, request: Request) -> Response:
        """Prometheus text format (see `hpref.serve.metrics`); the bearer token guards it too."""
        if not self._authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)")
        exports = await asyncio.to_thread(lambda: metrics.fetch(metrics.node_exports()))
        running = await asyncio.to_thread(running_replicas)
        body = metrics.render(exports, self.info, running)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/health")
    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @api.get("/ready")
    async def ready(self) -> JSONResponse:
        running = await asyncio.to_thread(running_replicas)
        wanted = self.settings.replicas
        ready = running >= wanted and not self.drain.stopping
        body = {"ready": ready, "replicas_running": running, "replicas_wanted": wanted}
        if self.drain.stopping:
            body["stopping"] = True
        return JSONResponse(body, status_code=200 if ready else 503)
