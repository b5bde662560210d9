"""`hpref serve` under sustained overload with replicas killed (issue #41): does it shed load, lose
nothing and hold its memory?

    .venv/bin/python -m benchmarks.serve_soak [--seconds 600] [--overload 2.0] [--kill-every 60]
        [--replicas 2] [--threads 1] [--max-queued 64] [--export FOLDER] [--work DIR] [--out FILE]

1. Starts `hpref serve EXPORT --replicas R --threads T` (the MiniLM reward export of
   `benchmarks.serve`, bf16 on a CPU that has it) on a loopback port.
2. Measures its saturation rate: 32 closed-loop clients for 20 s (requests/s answered 200).
3. Sends an open loop at `--overload` x that rate for `--seconds` (each request at its scheduled
   time, whatever the state of the others; bounded: rate x seconds requests, then it waits at most
   120 s for the last answers) while a SIGKILL hits a random replica every `--kill-every` seconds.
   Each request is retried as a real client retries (`RETRY_PAUSES_S`: a 500 or other 5xx but 503,
   or no status, is tried again up to 3 more times, 0.5 / 1 / 2 s apart, as `hpref rl`'s `remote`
   reward does; a 503 is the load shed, not retried).
4. Reports each request once, by how it ended: answered 200 at the first try, answered 200 on a
   retry, shed (503), failed (its last try a 500 or other error status, or no status: a connection
   dropped or refused, a client timeout; those are also counted as lost), and what the first tries
   alone got; p50/p99 of the 200s (from the first send, retries included); each replica's RSS
   (sampled every 5 s) when first seen, after its first minute under the load, and when last seen.

Targets (the issue's): 0 failed (a 500 is a failure unless a retry gets the request answered; it
was counted as answered before issue #47) and 0 lost; no replica's RSS grows more than 10 % from
the end of its first minute (its warm-up: the allocator grows to the largest batches this load
forms) to its last sample. Exit 1 when a request failed. Loopback only; the load generator is one
asyncio process on the same cores (said in the report, with the load average). The suite's short
version is `test_a_killed_replica_is_restarted_while_the_other_serves` (tests/serve/test_server.py):
one kill under a steady load, every request answered; the accounting is
tests/serve/test_soak_accounting.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.common import REPO, python_module, write_json
from benchmarks.serve import closed_loop, free_port, minilm_export, requests_of, stop, wait_ready

ENDPOINT = "/remote_rm"
REPLICA_TITLE = "ServeReplica:hpref:HprefScorer"
SATURATION_CLIENTS = 32
SATURATION_S = 20.0
DRAIN_WAIT_S = 120.0
#: a replica's first minute under the load is its warm-up (see `summary`)
WARM_S = 60.0


def replicas_of(server: subprocess.Popen) -> list:
    import psutil

    found = []
    for process in psutil.Process(server.pid).children(recursive=True):
        try:
            if REPLICA_TITLE in " ".join(process.cmdline()):
                found.append(process)
        except psutil.Error:
            continue
    return found


#: a client's retries of a request a replica did not answer (a 5xx other than the shed 503, or no
#: status at all: what a killed replica leaves), as `hpref rl`'s `remote` reward retries them
#: (`hpref.builtin.remote_reward`: 3 more tries, 0.5 / 1 / 2 s apart; OpenRLHF's client: 4 more,
#: 1 s apart). A 503 is not retried: it is the load the service sheds by design, and a retry would
#: offer that load again on top of the open loop's rate.
RETRY_PAUSES_S = (0.5, 1.0, 2.0)


def retried(status: int | str) -> bool:
    """Whether a client retries an attempt that ended in `status` (an HTTP status, or the name of
    the error that left it without one)."""
    return not isinstance(status, int) or (status >= 500 and status != 503)


async def open_loop(url: str, bodies: list[dict], rate: float, seconds: float) -> list:
    """Requests at `rate` per second for `seconds`, each retried as `RETRY_PAUSES_S` says; each
    request's (status of each attempt, seconds from its first send to its last answer)."""
    import aiohttp

    outcomes: list = []

    async def attempt(body: dict) -> int | str:
        try:
            async with session.post(url, json=body) as reply:
                await reply.read()
                return reply.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return type(exc).__name__

    async def one(body: dict) -> None:
        started = time.perf_counter()
        statuses = [await attempt(body)]
        for pause in RETRY_PAUSES_S:
            if not retried(statuses[-1]):
                break
            await asyncio.sleep(pause)
            statuses.append(await attempt(body))
        outcomes.append((statuses, time.perf_counter() - started))

    connector = aiohttp.TCPConnector(limit=1024)
    timeout = aiohttp.ClientTimeout(total=DRAIN_WAIT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        begin, tasks = time.perf_counter(), []
        for i in range(int(rate * seconds)):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(bodies[i % len(bodies)])))
        await asyncio.gather(*tasks)
    return outcomes


def accounting(outcomes: list) -> dict:
    """Each request counted once, by how it ended: answered 200 at the first try, answered 200 on a
    retry, shed (a 503 at any try), or failed: its last try, the retries spent, was a 500 or other
    error status, or got no status (those also counted as lost). A 500 is never an answer."""
    counts = {"answered_first_try": 0, "answered_on_retry": 0, "shed_503": 0, "failed": 0, "lost": 0}
    failed_as: dict[str, int] = {}
    for statuses, _seconds in outcomes:
        last = statuses[-1]
        if last == 200:
            counts["answered_first_try" if len(statuses) == 1 else "answered_on_retry"] += 1
        elif last == 503:
            counts["shed_503"] += 1
        else:
            counts["failed"] += 1
            counts["lost"] += not isinstance(last, int)
            failed_as[str(last)] = failed_as.get(str(last), 0) + 1
    first = [statuses[0] for statuses, _ in outcomes]
    return {
        "sent": len(outcomes),
        **counts,
        "failed_as": failed_as,
        "retried": sum(len(statuses) > 1 for statuses, _ in outcomes),
        # tries that got no status at all (a dropped or refused connection), retried or not
        "tries_without_status": sum(not isinstance(s, int) for statuses, _ in outcomes for s in statuses),
        # what the first try alone got: the old accounting's figures (a 500 was counted as answered)
        "first_try_status": {str(s): first.count(s) for s in sorted(set(first), key=str)},
    }


async def chaos(
    server: subprocess.Popen, seconds: float, every: float, rng: random.Random, log: list
) -> dict:
    """Kill a random replica every `every` s; sample every replica's RSS every 5 s."""
    rss: dict[int, list[tuple[float, float]]] = {}
    begin = time.monotonic()
    next_kill = begin + every if every > 0 else float("inf")
    while time.monotonic() - begin < seconds:
        for replica in replicas_of(server):
            try:
                sample = (time.monotonic() - begin, replica.memory_info().rss / 2**20)
                rss.setdefault(replica.pid, []).append(sample)
            except Exception:
                continue
        if time.monotonic() >= next_kill:
            alive = replicas_of(server)
            if alive:
                victim = rng.choice(alive)
                os.kill(victim.pid, signal.SIGKILL)
                log.append({"at_s": round(time.monotonic() - begin, 1), "pid": victim.pid})
                print(f"  killed replica {victim.pid} at {log[-1]['at_s']} s", flush=True)
            next_kill += every
        await asyncio.sleep(5)
    return rss


async def soak(server, url: str, bodies: list[dict], rate: float, args) -> tuple[list, dict, list]:
    kills: list = []
    rng = random.Random(args.seed)
    load, memory = await asyncio.gather(
        open_loop(url, bodies, rate, args.seconds), chaos(server, args.seconds, args.kill_every, rng, kills)
    )
    return load, memory, kills


def summary(outcomes: list, memory: dict, kills: list, saturation: float, rate: float, args) -> dict:
    ok = sorted(seconds for statuses, seconds in outcomes if statuses[-1] == 200)

    def quantile(q: float) -> float:
        return round(1000 * ok[min(len(ok) - 1, int(q * len(ok)))], 1) if ok else float("nan")

    replicas = {}
    for pid, series in memory.items():
        born, first = series[0]
        # growth from the replica's first minute on: the first minute is warm-up (the allocator
        # growing to the largest batches under this load), not a leak
        settled = next((mib for at, mib in series if at - born >= WARM_S), None)
        last_at, last = series[-1]
        replicas[str(pid)] = {
            "born_s": round(born),
            "lived_s": round(last_at - born),
            "first_mib": round(first, 1),
            "after_first_minute_mib": None if settled is None else round(settled, 1),
            "last_mib": round(last, 1),
            "growth_after_first_minute": None if settled is None else round(last / settled - 1, 3),
            "series": [(round(at), round(mib, 1)) for at, mib in series],
        }
    return {
        "seconds": args.seconds,
        "saturation_requests_per_s": round(saturation, 1),
        "offered_requests_per_s": round(rate, 1),
        "retry_pauses_s": list(RETRY_PAUSES_S),
        **accounting(outcomes),
        "p50_ms": quantile(0.5),
        "p99_ms": quantile(0.99),
        "kills": kills,
        "replica_rss": replicas,
        "max_growth_after_first_minute": max(
            [
                r["growth_after_first_minute"]
                for r in replicas.values()
                if r["growth_after_first_minute"] is not None
            ]
            or [float("nan")]
        ),
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.serve_soak", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--overload", type=float, default=2.0, help="offered rate / measured saturation")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills (0: none)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-queued", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--export", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpref-serve-soak"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    export = args.export or minilm_export(args.work)
    bodies = requests_of(500)
    port, log = free_port(), args.work / "serve.log"
    cmd = python_module("hpref", "serve", str(export), "--port", str(port), "--replicas", str(args.replicas))
    cmd += ["--threads", str(args.threads), "--max-queued", str(args.max_queued)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    with open(log, "a") as out:
        server = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, base + "/ready", log)
        measured = asyncio.run(closed_loop(base + ENDPOINT, bodies, SATURATION_CLIENTS, SATURATION_S))
        saturation = measured["requests_per_s"]
        rate = args.overload * saturation
        every = f"a replica killed every {args.kill_every:g} s" if args.kill_every else "no kills"
        print(
            f"saturation {saturation:.1f} req/s; offering {rate:.1f} req/s for {args.seconds:g} s, {every}",
            flush=True,
        )
        outcomes, memory, kills = asyncio.run(soak(server, base + ENDPOINT, bodies, rate, args))
        result = summary(outcomes, memory, kills, saturation, rate, args)
    finally:
        stop(server)
    print(
        f"sent {result['sent']}: answered 200 {result['answered_first_try']} at the first try and "
        f"{result['answered_on_retry']} on a retry, shed 503 {result['shed_503']}, failed "
        f"{result['failed']} {result['failed_as']} (lost: {result['lost']}); a 500 counts as failed "
        f"unless a retry ({len(RETRY_PAUSES_S)} more tries, {RETRY_PAUSES_S} s apart) got a 200; "
        f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms of the 200s (retries included); "
        f"RSS growth after a replica's first minute, at most {result['max_growth_after_first_minute']}"
    )
    for pid, r in result["replica_rss"].items():
        print(
            f"  replica {pid}: {r['first_mib']} -> {r['after_first_minute_mib']} (1 min) -> "
            f"{r['last_mib']} MiB, seen from {r['born_s']} s, lived {r['lived_s']} s"
        )
    if args.out:
        write_json(args.out, result)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
