"""`hpref save --now` from the run folder's side: the heartbeat, the trigger file, and waiting for
the save it asked for (a `step-*` checkpoint of a training run, a `rollout-*` save of an rl run)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from hpref.errors import UserError
from hpref.runfolder.checkpoints import complete_saves, resolve_checkpoint
from hpref.runfolder.heartbeat import clear_heartbeat, write_heartbeat
from hpref.runfolder.layout import HEARTBEAT, SAVE_NOW
from hpref.runfolder.record import CheckpointRecord, write_record
from hpref.runfolder.safe_load import CheckpointError
from hpref.runfolder.save_trigger import check_save_trigger, check_save_trigger_all_ranks, request_save_now


def _fake_complete_checkpoint(run_dir, step):
    folder = run_dir / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    (folder / "train_state.json").write_text("{}")
    (run_dir / "checkpoints" / "latest").write_text(folder.name)


def _fake_rl_save(run_dir, rollout):
    """What the rl leader's global save leaves: the parts, then the record naming them."""
    rel = f"checkpoints/rollout-{rollout:06d}"
    (run_dir / rel / "a").mkdir(parents=True)
    write_record(run_dir, CheckpointRecord("a", {"a": rollout}, save_dir=rel))


def test_save_now_waits_for_the_checkpoint_the_trainer_writes(tmp_path):
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    stop = threading.Event()

    def trainer():  # what the real loop must do at each step boundary
        step = 3
        while not stop.is_set():
            write_heartbeat(run_dir, step)
            if check_save_trigger_all_ranks(run_dir):
                _fake_complete_checkpoint(run_dir, step)
            step += 1
            time.sleep(0.02)
        clear_heartbeat(run_dir)

    _fake_complete_checkpoint(run_dir, 1)  # an older checkpoint must not satisfy the request
    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        path = request_save_now(run_dir, timeout=10, poll=0.02)
    finally:
        stop.set()
        thread.join()
    assert path.name != "step-000001" and path.is_dir()
    assert not (run_dir / SAVE_NOW).exists()  # the trainer consumed the trigger
    assert not (run_dir / HEARTBEAT).exists()


def test_save_now_waits_for_the_rollout_save_an_rl_run_records(tmp_path):
    """An rl run's saves are `rollout-*` folders, complete once the record names them: the request
    is answered by the save the record names after the trigger, not by an older one, and not by a
    folder the leader is still writing."""
    run_dir = tmp_path / "rl"
    run_dir.mkdir()
    _fake_rl_save(run_dir, 2)
    stop = threading.Event()
    half_written = run_dir / "checkpoints" / "rollout-000900"
    half_written.mkdir(parents=True)  # no record names it: never an answer

    def leader():  # the rl driver: a heartbeat, the trigger read after each rollout
        rollout = 3
        while not stop.is_set():
            write_heartbeat(run_dir, rollout)
            if check_save_trigger(run_dir):
                _fake_rl_save(run_dir, rollout)
            rollout += 1
            time.sleep(0.02)
        clear_heartbeat(run_dir)

    thread = threading.Thread(target=leader, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)
        path = request_save_now(run_dir, timeout=10, poll=0.02)
    finally:
        stop.set()
        thread.join()
    assert path.name.startswith("rollout-") and path.name not in ("rollout-000002", half_written.name)
    assert complete_saves(run_dir)[-1] == path
    assert not (run_dir / SAVE_NOW).exists()


def test_an_rl_save_is_not_exported_as_a_preference_model(tmp_path):
    run_dir = tmp_path / "rl"
    _fake_rl_save(run_dir, 4)
    with pytest.raises(CheckpointError, match="an hpref rl save"):
        resolve_checkpoint(run_dir)
    with pytest.raises(CheckpointError, match="an hpref rl save"):
        resolve_checkpoint(run_dir / "checkpoints" / "rollout-000004")


def test_save_now_reports_a_run_that_is_not_alive(tmp_path):
    run_dir = tmp_path / "dead"
    run_dir.mkdir()
    with pytest.raises(UserError, match="not alive: no heartbeat.json"):
        request_save_now(run_dir, timeout=1)
    (run_dir / HEARTBEAT).write_text(
        json.dumps(
            {"pid": 2**22 + 12345, "host": __import__("socket").gethostname(), "step": 1, "time": time.time()}
        )
    )
    with pytest.raises(UserError, match=r"pid \d+\) is not running"):
        request_save_now(run_dir, timeout=1)
    write_heartbeat(run_dir, 5)
    beat = json.loads((run_dir / HEARTBEAT).read_text())
    beat["time"] -= 3600
    (run_dir / HEARTBEAT).write_text(json.dumps(beat))
    with pytest.raises(UserError, match="3600 s old"):
        request_save_now(run_dir, timeout=1)
    assert not (run_dir / SAVE_NOW).exists()  # no trigger is left for a dead run


def test_save_now_gives_up_when_the_trainer_dies_while_waiting(tmp_path):
    run_dir = tmp_path / "dies"
    run_dir.mkdir()
    write_heartbeat(run_dir, 1)
    threading.Timer(0.1, clear_heartbeat, args=(run_dir,)).start()
    with pytest.raises(UserError, match="stopped before saving"):
        request_save_now(run_dir, timeout=10, poll=0.02)
    assert not (run_dir / SAVE_NOW).exists()
