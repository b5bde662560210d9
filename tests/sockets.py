"""A test's process tree, read from /proc, and what it listens on: the TCP listeners (`ss -ltnp`) of
a process tree, and those bound beyond loopback. The loopback checks of torchrun runs
(test_watchdog.py) and of the Ray clusters `hpref rl` starts or joins (rl/control/test_stop_signals.py,
test_cluster.py) share them, and the orphan checks of the watchdog and stop-signal tests."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: the mark of a test that reads /proc and runs `ss`
needs_ss = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("ss") is None, reason="uses /proc and ss"
)

LOOPBACK = ("127.0.0.1", "[::1]", "[::ffff:127.0.0.1]")


def descendants(root: int) -> set[int]:
    """Every process below `root` (children, their children, ...), from /proc."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parent[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def listening(pids: set[int]) -> list[str]:
    """`ss -ltnp` lines (TCP listeners) that belong to one of `pids`."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]


def beyond_loopback(lines: list[str]) -> list[str]:
    """The `listening` lines whose local address is not a loopback one."""
    return [line for line in lines if line.split()[3].rpartition(":")[0] not in LOOPBACK]


def alive(pid: int) -> bool:
    """Running or stopped, not gone and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def cmdline(pid: int) -> str:
    """The process's command line, "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
