"""Shared pieces: process-tree peak memory sampling (RSS and PSS), timed subprocesses, JSON specs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def tree_pids(pid: int) -> list[int]:
    """A process and all its descendants (psutil), [] if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root.pid, *(c.pid for c in root.children(recursive=True))]
    except psutil.Error:
        return []


def tree_rss(pid: int) -> int:
    """RSS in bytes of a process and all its descendants, 0 if it is gone."""
    import psutil

    total = 0
    for p in tree_pids(pid):
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(p).memory_info().rss
    return total


def tree_pss(pid: int) -> int:
    """PSS in bytes of a process and all its descendants (`/proc/<pid>/smaps_rollup`; Linux).

    Summed RSS counts a page shared by several processes once per process: for a Ray run (a driver,
    raylet, GCS and one worker per actor, all mapping torch and the object store) it overstates
    what the machine holds. PSS splits each shared page between its users, so the sum over the tree
    is the tree's real footprint; for a single process the two are almost equal. Reading it walks
    the page tables (~0.1 s for a 20 GiB process), so it is sampled far less often than RSS."""
    total = 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


def run_measured(
    cmd: list[str], log: Path, *, env: dict[str, str] | None = None, timeout: float = 1800
) -> dict:
    """Run `cmd`, sampling the peak RSS of its whole process tree every 250 ms and its PSS every 3 s
    (cheap enough not to slow what it measures); wall time, exit code, mean load average."""
    try:
        import psutil  # noqa: F401

        have_psutil = True
    except ImportError:
        have_psutil = False
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env or os.environ.copy()
        )
        peak = peak_pss = 0
        loads = [os.getloadavg()[0]]
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak, peak_pss
            tick = 0
            while not stop.is_set():
                peak = max(peak, tree_rss(proc.pid))
                if tick % 12 == 0:
                    peak_pss = max(peak_pss, tree_pss(proc.pid))
                    loads.append(os.getloadavg()[0])
                tick += 1
                stop.wait(0.25)

        thread = threading.Thread(target=sample, daemon=True)
        if have_psutil:
            thread.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        stop.set()
        if have_psutil:
            thread.join()
    wall = time.perf_counter() - start
    if not have_psutil:  # the largest single descendant only: a lower bound for several processes
        import resource

        peak = peak_pss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    # The 1-minute load average while it ran: on a shared machine it says how many other runnable
    # processes competed for the cores (a 2-core box at load 6 gives each of them a third of one).
    return {
        "rc": rc,
        "wall_s": wall,
        "peak_rss_gib": peak / 2**30,
        "peak_pss_gib": peak_pss / 2**30,
        "load_mean": sum(loads) / len(loads),
        "log": str(log),
    }


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2))
    return path


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def random_rollout(
    rollout_id: int,
    rng: Any,
    *,
    prompts: int = 8,
    group: int = 4,
    prompt_tokens: tuple[int, int] = (100, 290),
    answer_tokens: tuple[int, int] = (20, 64),
    vocab: int = 40000,
    logprob: float = -5.0,
) -> Any:
    """An rl rollout of random token ids below `vocab` (a trainer's input, an
    `hpref.rl.rollout_types.Rollout`), shaped like `recipes/rl-smollm2.toml`'s by default: 8 prompts
    of 100-289 tokens x 4 answers of 20-63, every answer token's engine log-prob `logprob`. `rng`: a
    `random.Random`, so a caller's rollouts are the same from run to run."""
    prompt_ids, completions = [], []
    for _ in range(prompts):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randrange(*prompt_tokens))]
        for _ in range(group):
            prompt_ids.append(prompt)
            completions.append([rng.randrange(100, vocab) for _ in range(rng.randrange(*answer_tokens))])
    from hpref.rl.rollout_types import rollout_of_tokens

    return rollout_of_tokens(
        rollout_id,
        prompt_ids,
        completions,
        [[logprob] * len(c) for c in completions],
        [rng.random() for _ in completions],
        group,
    )
