"""An `hpref rl` run whose `record.json` write hits a full disk (issue #47): the save it could not
record is whole, and a resume continues from it, not from the save before. In process: the driver's
own global save (`hpref.rl.control.driver.save_all`) and restore against in-process trainers and executor
that write and read their parts, the full disk a monkeypatched `open` failing the run's record only.
"""

from __future__ import annotations

import asyncio
import builtins
import errno
import io
import json
from pathlib import Path

import pytest

from tests.rl.local_actor import LocalActor


class PartWriter:
    """A trainer or the executor as far as a save is concerned: it writes its position into its
    part of the save, and a restore reads it back."""

    def __init__(self, name: str) -> None:
        self.name, self.position = name, 0

    def save(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "state.json").write_text(json.dumps({"position": self.position}))

    def load(self, folder: str) -> int:
        self.position = json.loads((Path(folder) / "state.json").read_text())["position"]
        return self.position


class Executor(PartWriter):
    def save(self, folder: str) -> None:
        from hpref.runfolder.layout import EXECUTOR_STATE

        super().save(folder)
        (Path(folder) / EXECUTOR_STATE).write_text("{}")  # what makes an rl save whole (`rl_saves`)

    def load(self, folder: str) -> dict:
        super().load(folder)
        return {"a": self.position}


def handles_at(position: int):
    from hpref.rl.control.driver import Handles

    trainer, executor = PartWriter("a"), Executor("executor")
    trainer.position = executor.position = position
    return Handles(
        LocalActor(executor), {"a": None}, {"a": LocalActor(trainer)}
    )  # no engine: see push_weights


def test_a_failed_record_write_resumes_from_the_save_it_could_not_record(tmp_path, monkeypatch):
    """Saves at rollouts 2 and 4; the run's `record.json` write after rollout 4's parts fails with
    ENOSPC. Wrong if a resume (`hpref.rl.control.driver.restore`) or `hpref save RL_RUN` (`resolve_rl_save`)
    lands on rollout 2 (one save back), if nothing says why it took rollout 4, or if the next save
    does not descend from rollout 4 (its lineage)."""
    from loguru import logger

    from hpref.rl.control.driver import restore, save_all
    from hpref.runfolder.checkpoints import resolve_rl_save
    from hpref.runfolder.record import read_record

    run = tmp_path / "run"
    run.mkdir()
    asyncio.run(save_all(handles_at(2), ["a"], {"a": 2}, run, "a"))

    real_open, failed = builtins.open, []

    def full_disk(file, mode="r", *args, **kwargs):
        path = Path(str(file))
        if path.parent == run and path.name.startswith(".record.json") and "w" in mode:
            failed.append(path.name)
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_disk)
    monkeypatch.setattr(io, "open", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        asyncio.run(save_all(handles_at(4), ["a"], {"a": 4}, run, "a"))
    monkeypatch.undo()
    assert len(failed) == 1
    assert json.loads((run / "record.json").read_text())["save_dir"] == "checkpoints/rollout-000002"

    pushed: list[str] = []

    async def push_weights(trainer, engine, policy, bucket_bytes):  # no engine here: what was pushed
        pushed.append(policy)

    monkeypatch.setattr("hpref.rl.control.driver.push_weights", push_weights)
    said: list[str] = []
    handler = logger.add(lambda m: said.append(str(m)), level="WARNING", format="{message}")
    try:
        fresh = handles_at(0)
        starts, record = asyncio.run(restore(fresh, ["a"], run))
    finally:
        logger.remove(handler)
    assert starts == {"a": 4} and record.save_dir == "checkpoints/rollout-000004" and pushed == ["a"]
    assert any("names rollout-000002, and rollout-000004 continues it" in line for line in said), said
    assert resolve_rl_save(run) == run / "checkpoints" / "rollout-000004"

    asyncio.run(save_all(handles_at(6), ["a"], {"a": 6}, run, "a"))
    newest = read_record(run)
    assert newest.save_dir == "checkpoints/rollout-000006" and newest.lineage.parent == "rollout-000004"
