"""Where a serve replica's RSS goes after its first minute (issue #47): one `hpref serve`
replica's scoring, in a fresh process per variant (a replacement replica after a kill starts so),
its RSS sampled after every packed pass.

    .venv/bin/python -m benchmarks.serve_replica_memory [--passes 80] [--batch 32] [--seed 0]
        [--variant replica|largest-warm-up|no-onednn-cache|mmap-threshold|all] [--work DIR] [--out FILE]

Each run is what a replica (`hpref.serve.app.HprefScorer`) does: the MiniLM reward export of
`benchmarks.serve`, oneDNN's cache capped (`hpref.memory`), one torch thread, its one-short-battle
warm-up, one scoring thread, freed pages handed back at most once a second
(`hpref.memory.PeriodicRelease`); then `--passes` packed passes of 1-`--batch` HH-RLHF requests
(`benchmarks.serve.requests_of`; the same `--seed` draws for every variant). Variants, each one
change to that replica: `largest-warm-up` (its warm-up the largest pass its options allow,
`max_batch_size` requests cut at the formatter's max_length, in the scoring thread),
`no-onednn-cache` (`ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`), `mmap-threshold` (glibc's mmap threshold
fixed at 256 KiB: large blocks never come from the heap). Reported per variant: RSS after the load,
after the warm-up, at passes 25 / 50 / 100 and at the end, the peak, seconds a pass, the growth from
each mark to the end, and the Python heap's blocks (`sys.getallocatedblocks`) at pass 25 and at the
end. A replica on the shared 2-core machine serves ~26 passes of 32 in the soak's first minute
(~14 requests/s), so pass 25 is where `benchmarks.serve_soak` takes its baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, write_json

MARKS = (25, 50, 100)
VARIANTS = ("replica", "largest-warm-up", "no-onednn-cache", "mmap-threshold")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_run(export: Path, variant: str, passes: int, batch: int, seed: int) -> dict:
    """In this process: a replica's start and `passes` passes; RSS after each."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from benchmarks.serve import requests_of
    from hpref.builtin.scoring import ExportScorer
    from hpref.memory import ONEDNN_CACHE_ENV, PeriodicRelease, cap_onednn_cache
    from hpref.serve import shapes
    from hpref.serve.app import ServeSettings

    if variant == "no-onednn-cache":
        os.environ[ONEDNN_CACHE_ENV] = "0"
    if variant == "mmap-threshold":
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if libc.mallopt(M_MMAP_THRESHOLD, 256 * 1024) != 1:
            raise SystemExit("mallopt(M_MMAP_THRESHOLD) refused")
    cap_onednn_cache()
    torch.set_num_threads(1)
    settings = ServeSettings(export=str(export))
    scorer = ExportScorer.load(export, micro_batch_tokens=settings.micro_batch_tokens, precision="auto")
    loaded = rss_mib()
    scoring = ThreadPoolExecutor(max_workers=1)
    release = PeriodicRelease(1.0)

    def score_pass(jobs: list) -> None:  # `HprefScorer._score_pass`
        try:
            shapes.score_jobs(scorer, jobs)
        finally:
            release()

    if variant == "largest-warm-up":
        words = int(getattr(scorer.formatter, "max_length", None) or 512)
        text = "warm-up " * words  # a token or more a word: cut at the formatter's max_length
        largest = [scorer.judge_job((text,), text, text, swap=True) for _ in range(settings.max_batch_size)]
        scoring.submit(score_pass, largest).result()
    else:  # the replica's own warm-up (`HprefScorer.__init__`)
        scorer.run([scorer.judge_job(("warm-up",), "a", "b", swap=False)])
    warmed = rss_mib()
    limits = shapes.Limits()
    jobs = [shapes.parse_remote_rm(body, scorer, limits)[0] for body in requests_of(500)]
    rng = random.Random(seed)
    series, blocks = [], {}
    began = time.perf_counter()
    for n in range(1, passes + 1):
        chosen = [jobs[rng.randrange(len(jobs))] for _ in range(rng.randint(1, batch))]
        scoring.submit(score_pass, chosen).result()
        series.append(round(rss_mib(), 1))
        if n in (25, passes):
            blocks[str(n)] = sys.getallocatedblocks()
    seconds = time.perf_counter() - began
    end = series[-1]
    at = {str(m): series[m - 1] for m in MARKS if m <= passes}
    return {
        "variant": variant,
        "loaded_mib": round(loaded, 1),
        "warmed_mib": round(warmed, 1),
        "at_pass_mib": at,
        "end_mib": end,
        "peak_mib": max(series),
        "pass_s": round(seconds / passes, 3),
        "growth_to_end": {
            "warm-up": round(end / warmed - 1, 3),
            **{k: round(end / v - 1, 3) for k, v in at.items()},
        },
        "python_blocks": blocks,
        "series": series,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="benchmarks.serve_replica_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--passes", type=int, default=80)
    parser.add_argument("--variant", choices=[*VARIANTS, "all"], default="all")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path("/tmp/hpref-serve-soak"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child run: JSON on stdout
    args = parser.parse_args(argv)
    from benchmarks.serve import minilm_export

    args.work.mkdir(parents=True, exist_ok=True)
    export = minilm_export(args.work)
    if args.one:
        print(json.dumps(one_run(export, args.one, args.passes, args.batch, args.seed)))
        return 0
    runs = []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for variant in VARIANTS if args.variant == "all" else (args.variant,):
        cmd = [sys.executable, "-m", "benchmarks.serve_replica_memory", "--one", variant]
        cmd += ["--passes", str(args.passes), "--batch", str(args.batch), "--seed", str(args.seed)]
        cmd += ["--work", str(args.work)]
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{variant}: exit {done.returncode}: {done.stderr[-2000:]}")
        run = json.loads(done.stdout.strip().splitlines()[-1])
        runs.append(run)
        at = ", ".join(f"pass {k} {v}" for k, v in run["at_pass_mib"].items())
        print(
            f"{variant}: loaded {run['loaded_mib']} -> warmed {run['warmed_mib']} -> {at} -> "
            f"end {run['end_mib']} MiB (peak {run['peak_mib']}), {run['pass_s']} s a pass, Python "
            f"heap blocks {run['python_blocks']}; growth to the end from "
            + ", ".join(f"{k}: {100 * v:.0f} %" for k, v in run["growth_to_end"].items()),
            flush=True,
        )
    if args.out:
        write_json(args.out, {"passes": args.passes, "batch": args.batch, "seed": args.seed, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
