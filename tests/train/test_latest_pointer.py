"""A `latest` pointer whose write hits a full disk (issue #47): `--resume auto` continues from the
save the pointer could not name and says so, and an abandoned timeline's newer save is still never
resumed. In process, through the functions a training rank calls (`train.resume.save` /
`restore`, `train.checkpoint.resolve_resume`) on a one-layer model: the full disk is a
monkeypatched `open` that fails the pointer's write only, as `test_units`' full disk fails a shard's.
"""

from __future__ import annotations

import builtins
import errno
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


class Sampler:
    """The state a sampler checkpoints: where it is."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def make_setup(run_dir: Path) -> SimpleNamespace:
    """What `train.resume.save` / `restore` read of a run's setup: a 4x2 linear model (no LoRA, no
    objective), AdamW, a scheduler, a sampler, and `keep_checkpoints` high enough to keep every save."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return SimpleNamespace(
        run_dir=run_dir,
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        sampler=Sampler(),
        objective=None,
        total_steps=100,
        recipe=SimpleNamespace(lora=None, dpo=None, train=SimpleNamespace(keep_checkpoints=100)),
    )


def save_at(setup: SimpleNamespace, step: int, value: float) -> None:
    """A save after `step` whose weights are all `value`: which save a resume loaded is then plain."""
    from hpref.train import resume

    with torch.no_grad():
        for p in setup.model.parameters():
            p.fill_(value)
    setup.sampler.position = step
    resume.save(setup, step, epoch=0)


@pytest.fixture
def full_disk_for_latest(monkeypatch):
    """Arm it to make the next writes of `checkpoints/latest` (its temporary `.latest.<pid>.part`)
    fail with ENOSPC; every other write goes through."""
    real_open = builtins.open
    armed = {"on": False, "failed": 0}

    def open_(file, mode="r", *args, **kwargs):
        if armed["on"] and Path(str(file)).name.startswith(".latest.") and "w" in mode:
            armed["failed"] += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)
    return armed


def warnings_of(call):
    from loguru import logger

    messages: list[str] = []
    handler = logger.add(lambda m: messages.append(str(m)), level="WARNING", format="{message}")
    try:
        return call(), "\n".join(messages)
    finally:
        logger.remove(handler)


def pointer(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def test_a_failed_latest_write_resumes_from_the_save_it_could_not_name(tmp_path, full_disk_for_latest):
    """Step 3 saved whole, then its `latest` write failed: the save raised (one line, the OS
    error), `latest` still named step 2. Wrong if `--resume auto`, `hpref save`/`eval` (`find_latest`)
    or the weights loaded are step 2's (the run sent one save back), if the resume did not say which
    save it took and why, or if the pointer stayed behind after the resume (the next save would then
    descend from step 2 and the chain to step 3 would break)."""
    from hpref.runfolder.checkpoints import find_latest, resolve_checkpoint, timeline
    from hpref.train import resume
    from hpref.train.checkpoint import resolve_resume

    run = tmp_path / "run"
    setup = make_setup(run)
    save_at(setup, 1, 1.0)
    save_at(setup, 2, 2.0)
    full_disk_for_latest["on"] = True
    with pytest.raises(OSError, match="No space left on device"):
        save_at(setup, 3, 3.0)
    full_disk_for_latest["on"] = False
    root = run / "checkpoints"
    assert full_disk_for_latest["failed"] == 1 and pointer(run) == "step-000002"
    assert (root / "step-000003" / "train_state.json").is_file()  # the save itself is whole

    found, said = warnings_of(lambda: resolve_resume(run, "auto"))
    assert found == root / "step-000003"
    assert "latest names step-000002, and step-000003 continues it" in said, said
    assert find_latest(run) == resolve_checkpoint(run) == root / "step-000003"

    fresh = make_setup(run)
    assert resume.restore(fresh, found) == 3
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in fresh.model.parameters())
    assert fresh.sampler.position == 3
    assert pointer(run) == "step-000003"  # the resume put the pointer right
    save_at(fresh, 4, 4.0)
    assert timeline(run) == [root / f"step-00000{n}" for n in (4, 3, 2, 1)]


def test_an_abandoned_timeline_is_not_resumed_after_a_failed_latest_write(tmp_path, full_disk_for_latest):
    """Saves 1-4, then a resume from step 2 (`--resume .../step-000002`): its step 3 replaces the old
    step 3 and its `latest` write fails, so `latest` names step 2 and the old step 4 is the newest
    folder. Wrong if `--resume auto` takes the old step 4 (an abandoned timeline: what scanning for
    the newest verified folder did), or the new step 3 is taken for the old one's parent of step 4,
    or the weights loaded are not the resumed timeline's."""
    from hpref.runfolder.checkpoints import find_latest, timeline
    from hpref.train import resume
    from hpref.train.checkpoint import resolve_resume

    run = tmp_path / "run"
    root = run / "checkpoints"
    setup = make_setup(run)
    for step in (1, 2, 3, 4):
        save_at(setup, step, float(step))
    again = make_setup(run)
    assert resume.restore(again, root / "step-000002") == 2
    assert pointer(run) == "step-000002"
    # the documented window (hpref.runfolder.lineage): before the resumed timeline's first save,
    # the old saves still descend from what `latest` names
    assert find_latest(run) == root / "step-000004"
    full_disk_for_latest["on"] = True
    with pytest.raises(OSError, match="No space left on device"):
        save_at(again, 3, 30.0)
    full_disk_for_latest["on"] = False
    assert pointer(run) == "step-000002" and (root / "step-000004").is_dir()

    found, said = warnings_of(lambda: resolve_resume(run, "auto"))
    assert found == root / "step-000003", said
    assert "step-000004" not in said
    assert timeline(run) == [root / "step-000003", root / "step-000002", root / "step-000001"]
    fresh = make_setup(run)
    assert resume.restore(fresh, found) == 3
    assert all(torch.equal(p, torch.full_like(p, 30.0)) for p in fresh.model.parameters())
