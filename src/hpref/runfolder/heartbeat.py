"""`RUN_DIR/heartbeat.json`: how a live run says it is alive, and how others tell.

A running trainer or rl driver cannot be asked over a socket (it may be 8 ranks on another node),
so liveness is a file: the run refreshes it with `write_heartbeat` (pid, host, step, time) and
removes it at exit. `run_status` reads it: a missing or stale heartbeat, or a dead pid on this
host, is "not running" (so `hpref save --now` fails at once instead of waiting, and `hpref train
--overwrite` refuses to delete a run that is still writing).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from hpref.runfolder.layout import HEARTBEAT

HEARTBEAT_STALE_S = 300.0  # a step (plus eval or checkpoint) longer than this reads as a hung run


def write_heartbeat(run_dir: str | Path, step: int) -> None:
    """The run's side (rank 0, every step, or the rl driver every few seconds): "alive at this step"."""
    path = Path(run_dir) / HEARTBEAT
    data = {"pid": os.getpid(), "host": socket.gethostname(), "step": int(step), "time": time.time()}
    tmp = path.with_name(f".{HEARTBEAT}.{os.getpid()}.part")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def clear_heartbeat(run_dir: str | Path) -> None:
    """The run's side, at exit (normal or not): the run is no longer alive."""
    (Path(run_dir) / HEARTBEAT).unlink(missing_ok=True)


def run_status(run_dir: str | Path, stale_after: float = HEARTBEAT_STALE_S) -> tuple[bool, str]:
    """(alive, reason) from the heartbeat file: fresh, and its pid alive when on this host."""
    path = Path(run_dir) / HEARTBEAT
    try:
        beat = json.loads(path.read_text())
    except FileNotFoundError:
        return False, f"no {HEARTBEAT} in {run_dir} (the run is not training, or finished)"
    except (OSError, json.JSONDecodeError) as exc:
        return False, f"{path} is unreadable ({exc})"
    age = time.time() - float(beat.get("time", 0))
    if beat.get("host") == socket.gethostname() and not _pid_alive(int(beat.get("pid", -1))):
        return False, f"the trainer (pid {beat.get('pid')}) is not running"
    if age > stale_after:
        return (
            False,
            f"the last heartbeat is {age:.0f} s old (step {beat.get('step')}); the run looks hung or dead",
        )
    return True, f"pid {beat.get('pid')} on {beat.get('host')}, step {beat.get('step')}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
