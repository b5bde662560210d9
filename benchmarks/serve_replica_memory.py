"""Where a serve replica's RSS goes after its first minute (issue #47): one `hpref serve`
replica's scoring, in a fresh process per variant (a replacement replica after a kill starts so),
its RSS sampled after every packed pass.

    .venv/bin/python -m benchmarks.serve_replica_memory [--passes 80] [--batch 32] [--seed 0]
        [--variant replica|ideep-cache-1024|...|all] [--work DIR] [--out FILE]

Each run is what a replica (`hpref.serve.app.HprefScorer`) does: the MiniLM reward export of
`benchmarks.serve`, oneDNN's and ideep's per-shape caches capped (`hpref.memory`), one torch
thread, its one-short-battle warm-up, one scoring thread, freed pages handed back at most once a
second (`hpref.memory.PeriodicRelease`); then `--passes` packed passes of 1-`--batch` HH-RLHF
requests (`benchmarks.serve.requests_of`; the same `--seed` draws for every variant). Variants,
each one change to that replica: `ideep-cache-1024` (ideep's matmul cache at its default size,
`LRU_CACHE_CAPACITY=1024`: the replica before issue #47's fix), `largest-warm-up` (its warm-up the
largest pass its options allow, `max_batch_size` requests cut at the formatter's max_length, in the
scoring thread), `no-onednn-cache` (`ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`), `mmap-threshold` (glibc's
mmap threshold fixed at 256 KiB: large blocks never come from the heap), `arena-max-2`
(`MALLOC_ARENA_MAX=2`), `trim-thresholds` (`MALLOC_TRIM_THRESHOLD_` and `MALLOC_MMAP_THRESHOLD_` at
128 KiB), `trim-each-pass` (`malloc_trim(0)` after every pass), `jemalloc` (`LD_PRELOAD` of
Debian's libjemalloc2), `torch-threads-2` (two torch threads). Reported per variant: RSS after the
load, after the warm-up, at passes 25 / 50 / 100 and at the end, the peak, seconds and CPU seconds
a pass, the growth from each mark to the end, the Python heap's blocks (`sys.getallocatedblocks`)
and glibc's own account (`mallinfo2`: bytes in use, free, mmapped) with RssAnon / RssFile at pass
25 and at the end, and RSS after a `malloc_trim` there (what the replica keeps: RSS after a pass
also holds what it freed since the last trim) and its growth. glibc's bytes in use tell live
native memory (a cache, a leak) from freed memory the heap keeps (fragmentation). A replica on the
shared 2-core machine serves ~26 passes of 32 in the soak's first minute (~14 requests/s), so pass
25 is where `benchmarks.serve_soak` takes its baseline.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import REPO, write_json

MARKS = (25, 50, 100)
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian's libjemalloc2
#: variant -> what its child process's environment adds (the in-process changes are in `one_run`)
VARIANTS: dict[str, dict[str, str]] = {
    "replica": {},
    "largest-warm-up": {},
    "no-onednn-cache": {},
    "mmap-threshold": {},
    "arena-max-2": {"MALLOC_ARENA_MAX": "2"},
    "trim-thresholds": {"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_MMAP_THRESHOLD_": "131072"},
    "trim-each-pass": {},
    "jemalloc": {"LD_PRELOAD": JEMALLOC},
    "torch-threads-2": {},
    # the replica before issue #47's fix: ideep's matmul cache at its default size
    "ideep-cache-1024": {"LRU_CACHE_CAPACITY": "1024"},
}
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
        + ("fordblks", "keepcost")
    ]


def malloc_stats() -> dict[str, float]:
    """glibc's own account (`mallinfo2`, MiB): `heap` = its arenas' bytes from the OS, `in_use` of
    them, `free` in them (trimmed pages included: freed to the OS but still counted), `mmapped` =
    large blocks served by mmap. Meaningless under another allocator (LD_PRELOAD jemalloc)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    mib = 2**20
    return {
        "heap": round(info.arena / mib, 1),
        "in_use": round(info.uordblks / mib, 1),
        "free": round(info.fordblks / mib, 1),
        "mmapped": round(info.hblkhd / mib, 1),
    }


def rss_split() -> dict[str, float]:
    """RssAnon (heaps, mmaps) and RssFile (mapped libraries and files) from /proc/self/status, MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                key, value = line.split(":")
                out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def one_run(export: Path, variant: str, passes: int, batch: int, seed: int) -> dict:
    """In this process: a replica's start and `passes` passes; RSS after each."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from benchmarks.serve import requests_of
    from hpref.builtin.scoring import ExportScorer
    from hpref.memory import (
        ONEDNN_CACHE_ENV,
        PeriodicRelease,
        cap_ideep_cache,
        cap_onednn_cache,
        release_freed_memory,
    )
    from hpref.serve import shapes
    from hpref.serve.app import ServeSettings

    if variant == "no-onednn-cache":
        os.environ[ONEDNN_CACHE_ENV] = "0"
    if variant == "mmap-threshold":
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        if libc.mallopt(M_MMAP_THRESHOLD, 256 * 1024) != 1:
            raise SystemExit("mallopt(M_MMAP_THRESHOLD) refused")
    cap_onednn_cache()
    cap_ideep_cache()  # the environment's value wins: `ideep-cache-1024` sets the old default
    torch.set_num_threads(2 if variant == "torch-threads-2" else 1)
    settings = ServeSettings(export=str(export))
    scorer = ExportScorer.load(export, micro_batch_tokens=settings.micro_batch_tokens, precision="auto")
    loaded = rss_mib()
    scoring = ThreadPoolExecutor(max_workers=1)
    release = PeriodicRelease(0.0 if variant == "trim-each-pass" else 1.0)

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
    series, blocks, allocator, trimmed = [], {}, {}, {}
    began, cpu_began = time.perf_counter(), time.process_time()
    for n in range(1, passes + 1):
        chosen = [jobs[rng.randrange(len(jobs))] for _ in range(rng.randint(1, batch))]
        scoring.submit(score_pass, chosen).result()
        series.append(round(rss_mib(), 1))
        if n in (25, passes):
            blocks[str(n)] = sys.getallocatedblocks()
            allocator[str(n)] = {**malloc_stats(), **rss_split()}
            # RSS after a pass holds whatever it freed since the last once-a-second trim (up to a
            # pass's activations: which passes were trimmed depends on the machine's speed); after
            # a trim it is what the replica keeps, the figure that tells growth from that noise
            release_freed_memory()
            trimmed[str(n)] = round(rss_mib(), 1)
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu_began
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
        # CPU seconds a pass (all threads): a cost that a loaded machine's wall time would hide
        "pass_cpu_s": round(cpu_seconds / passes, 3),
        "growth_to_end": {
            "warm-up": round(end / warmed - 1, 3),
            **{k: round(end / v - 1, 3) for k, v in at.items()},
        },
        "python_blocks": blocks,
        "malloc_mib": allocator,
        "trimmed_rss_mib": trimmed,
        "trimmed_growth": round(trimmed[str(passes)] / trimmed["25"] - 1, 3) if "25" in trimmed else None,
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
    for variant in VARIANTS if args.variant == "all" else (args.variant,):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **VARIANTS[variant]}
        if "LD_PRELOAD" in VARIANTS[variant] and not Path(JEMALLOC).is_file():
            raise SystemExit(f"{variant}: {JEMALLOC} is missing (apt-get install libjemalloc2)")
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
            f"end {run['end_mib']} MiB (peak {run['peak_mib']}), {run['pass_s']} s "
            f"({run['pass_cpu_s']} CPU s) a pass, Python heap blocks {run['python_blocks']}, "
            f"malloc MiB {run['malloc_mib']}; growth to the end from "
            + ", ".join(f"{k}: {100 * v:.0f} %" for k, v in run["growth_to_end"].items())
            + f"; after a trim: {run['trimmed_rss_mib']} MiB, growth {run['trimmed_growth']}",
            flush=True,
        )
    if args.out:
        write_json(args.out, {"passes": args.passes, "batch": args.batch, "seed": args.seed, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
