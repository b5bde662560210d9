"""`hpref save --now`: ask a live run for a checkpoint through `RUN_DIR/SAVE_NOW`.

`request_save_now` (the command's side) checks the run's heartbeat (`hpref.runfolder.heartbeat`),
writes the trigger file and waits for a complete save newer than the newest that existed when it
asked (`hpref.runfolder.checkpoints.complete_saves`: a `step-*` checkpoint of a training run, or the
`rollout-*` save an `hpref rl` run's record names).

The run's side looks for the trigger at every boundary where a save is consistent: the trainer at
each optimizer step (`check_requests_all_ranks`: rank 0 looks for the file and removes it, the
answer is all-reduced with a stop request (SIGTERM, Ctrl-C), every rank then saves collectively,
and stops too when a stop was asked); the rl leader after each of its rollouts
(`check_save_trigger`, then its usual global save, parking the followers).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from loguru import logger

from hpref.errors import UserError
from hpref.runfolder.checkpoints import complete_saves
from hpref.runfolder.heartbeat import HEARTBEAT_STALE_S, run_status
from hpref.runfolder.layout import SAVE_NOW


def check_save_trigger(run_dir: str | Path) -> bool:
    """The run's side, at a save boundary: True (and the trigger removed) when a save was asked."""
    path = Path(run_dir) / SAVE_NOW
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def check_save_trigger_all_ranks(run_dir: str | Path) -> bool:
    """Collective: rank 0 checks the trigger, every rank gets its answer (saving is collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return check_save_trigger(run_dir)
    flag = [check_save_trigger(run_dir) if dist.get_rank() == 0 else False]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def check_requests_all_ranks(
    run_dir: str | Path, stop_signal: int = 0, device: Any = None
) -> tuple[bool, int]:
    """Collective, at a step boundary: (whether rank 0 found the save trigger, the signal a stop was
    asked by on any rank, 0 for none). One all-reduce of both, so every rank saves and stops at the
    same step whichever rank heard of the stop (`hpref.runtime.stop_signals`: each node's launcher
    tells its own ranks). `device`: where the group's collectives run (a GPU for nccl)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return check_save_trigger(run_dir), stop_signal
    save = check_save_trigger(run_dir) if dist.get_rank() == 0 else False
    flags = torch.tensor([int(save), int(stop_signal)], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), int(flags[1])


def request_save_now(
    run_dir: str | Path,
    *,
    timeout: float = 1800.0,
    poll: float = 1.0,
    stale_after: float = HEARTBEAT_STALE_S,
) -> Path:
    """Ask a live run for a save at its next boundary and wait until it is complete; returns it: the
    first complete save made since the request (an rl run's record names only its newest save, so
    when the run saved again before this looked, that newer one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    alive, reason = run_status(run_dir, stale_after)
    if not alive:
        raise UserError(f"{run_dir}: the run is not alive: {reason}")
    before = {p.name for p in complete_saves(run_dir)}
    trigger = run_dir / SAVE_NOW
    trigger.write_text(json.dumps({"requested": time.time(), "pid": os.getpid()}) + "\n")
    logger.info(f"asked {run_dir} ({reason}) for a checkpoint; waiting")
    deadline = time.monotonic() + timeout
    while True:
        new = [p for p in complete_saves(run_dir) if p.name not in before]
        if new and not trigger.exists():
            # the first save since the request: a run that saves again before this poll (an rl run
            # whose time limit ends at the next rollout) has made the asked-for save and a later one
            return new[0]
        if time.monotonic() > deadline:
            raise UserError(
                f"{run_dir}: no new checkpoint after {timeout:.0f} s (the trigger file is left in place)"
            )
        alive, reason = run_status(run_dir, stale_after)
        if not alive:
            trigger.unlink(missing_ok=True)
            raise UserError(f"{run_dir}: the run stopped before saving: {reason}")
        time.sleep(poll)
