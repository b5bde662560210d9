"""Liveness between a launcher (`hpref train`, `hpref eval`) and its torchrun workers.

Two failure modes torchrun does not catch on its own:

- A rank that stops (SIGSTOP, a frozen disk, a debugger left attached) does not exit, so torchrun's
  agent, which only polls exit codes, waits with it; the other ranks sit in a gloo collective for
  its full timeout (30 min by default). Each worker therefore runs a heartbeat thread that touches
  `HEARTBEAT_DIR/rank<N>` every few seconds; the launcher's `Watchdog` kills a rank whose file has
  not changed for `launch.heartbeat_timeout_s` and names it. A thread, not the training loop,
  beats: a rank that waits in a collective for a slow peer is alive and must not be blamed, so only
  the process that cannot run at all goes stale.
- A launcher killed with SIGKILL cannot stop its workers, which then train to the end as orphans.
  `die_with_parent` asks the kernel to SIGKILL the worker when the launcher goes.

The launcher hands both settings to the workers in the environment (torchrun passes its own
environment through), so a worker started by a plain `torchrun` has neither and runs as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

from hpref.runfolder.start import log_file

HEARTBEAT_DIR_ENV = "HPREF_HEARTBEAT_DIR"
HEARTBEAT_INTERVAL_ENV = "HPREF_HEARTBEAT_INTERVAL_S"
LAUNCHER_PID_ENV = "HPREF_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def heartbeat_interval(timeout_s: float) -> float:
    """A tenth of the timeout, so a few late beats on a loaded machine are not a verdict."""
    return min(5.0, max(0.2, timeout_s / 10))


def die_with_parent() -> None:
    """SIGKILL this process when the launcher that started it exits, however it exits.

    Linux only (`prctl(PR_SET_PDEATHSIG)`); elsewhere a no-op. The signal follows the *thread*
    that forked us: torchrun starts workers from the launcher's main thread, which lives as long
    as the launcher. SIGKILL rather than SIGTERM: nobody is left to collect a graceful exit, and
    checkpoints are renamed into place only when complete, so a kill at any moment loses at most
    the steps since the last one.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning(f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); orphans possible")
        return
    # The launcher may have died between our fork and the prctl call: then no signal comes, and
    # our parent is already someone else (init or a subreaper).
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected is not None and os.getppid() != int(expected):
        os._exit(1)


def start_heartbeat(rank: int) -> threading.Thread | None:
    """Touch `HEARTBEAT_DIR/rank<N>` (which holds our pid) from a daemon thread; None when this
    process was not started by an hpref launcher."""
    folder = os.environ.get(HEARTBEAT_DIR_ENV)
    if not folder:
        return None
    interval = float(os.environ.get(HEARTBEAT_INTERVAL_ENV, "1"))
    path = Path(folder) / f"rank{rank}"
    path.write_text(str(os.getpid()))

    def beat() -> None:
        while True:
            time.sleep(interval)
            try:
                os.utime(path)
            except OSError:  # the launcher removed the folder: it is ending the run
                return

    thread = threading.Thread(target=beat, name="hpref-heartbeat", daemon=True)
    thread.start()
    return thread


def _process_state(pid: int) -> str:
    """`T (stopped)` and the like from /proc, for the message; "" where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    state = stat.rpartition(")")[2].split()[0]
    names = {"T": "stopped", "t": "stopped by a tracer", "D": "in uninterruptible I/O", "Z": "zombie"}
    return f"{state} ({names[state]})" if state in names else state


@dataclass(frozen=True)
class Stall:
    rank: int
    pid: int
    seconds: float
    state: str

    def message(self, run_dir: Path) -> str:
        state = f", process {self.pid} state {self.state}" if self.state else f", process {self.pid}"
        return (
            f"rank {self.rank} stopped making progress: no heartbeat for {self.seconds:.0f} s{state}; "
            f"killed it and ended the run; log: {log_file(run_dir, f'rank{self.rank}')}"
        )


class Watchdog:
    """Watches the heartbeat files of this node's ranks from a daemon thread in the launcher.

    A rank is watched from its first beat (start-up before it is not timed: importing torch on a
    loaded machine takes what it takes). The age of a beat is measured on the launcher's monotonic
    clock from when it saw the file change, so wall-clock jumps do not matter.
    """

    def __init__(self, folder: Path, timeout_s: float) -> None:
        self.folder = Path(folder)
        self.timeout_s = timeout_s
        self.interval = heartbeat_interval(timeout_s)
        self.stall: Stall | None = None
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (mtime_ns, monotonic when it changed)
        self._thread = threading.Thread(target=self._watch, name="hpref-watchdog", daemon=True)

    def environment(self) -> dict[str, str]:
        return {
            HEARTBEAT_DIR_ENV: str(self.folder),
            HEARTBEAT_INTERVAL_ENV: str(self.interval),
            LAUNCHER_PID_ENV: str(os.getpid()),
        }

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            stall = self.check(time.monotonic())
            if stall is not None:
                self.stall = stall
                # SIGKILL works on a stopped process; torchrun then stops the other ranks as it
                # does for any failed rank.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stall.pid, signal.SIGKILL)
                return

    def check(self, now: float) -> Stall | None:
        for path in self.folder.glob("rank*"):
            try:
                rank = int(path.name[4:])
                mtime = path.stat().st_mtime_ns
                pid = int(path.read_text() or 0)
            except (OSError, ValueError):
                continue  # being written; next round
            last = self._seen.get(rank)
            if last is None or last[0] != mtime:
                self._seen[rank] = (mtime, now)
            elif now - last[1] > self.timeout_s and pid:
                return Stall(rank, pid, now - last[1], _process_state(pid))
        return None
