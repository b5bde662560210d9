"""Shared pieces: process-tree peak RSS sampling, timed subprocesses, JSON specs."""

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


def tree_rss(pid: int) -> int:
    """RSS in bytes of a process and all its descendants (psutil), 0 if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def run_measured(
    cmd: list[str], log: Path, *, env: dict[str, str] | None = None, timeout: float = 1800
) -> dict:
    """Run `cmd`, sampling the peak RSS of its whole process tree every 50 ms; wall time, exit code."""
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
        peak = 0
        loads = [os.getloadavg()[0]]
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, tree_rss(proc.pid))
                loads.append(os.getloadavg()[0])
                stop.wait(0.05)

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

        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    # The 1-minute load average while it ran: on a shared machine it says how many other runnable
    # processes competed for the cores (a 2-core box at load 6 gives each of them a third of one).
    return {
        "rc": rc,
        "wall_s": wall,
        "peak_rss_gib": peak / 2**30,
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
