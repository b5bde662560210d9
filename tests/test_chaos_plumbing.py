"""The chaos benchmarks' verdicts (benchmarks/chaos_train.py `verify`, benchmarks/chaos_rl.py `check`
and `failures`) on fabricated run folders, in process: a run that compared nothing fails and says
what it did not compare, a difference fails, and only a match passes. The real runs are the suite's
chaos tests (tests/train/test_engine.py, tests/rl/control/test_chaos_rl.py) and the benchmarks themselves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from benchmarks import chaos_rl, chaos_train  # noqa: E402

STEPS = 4  # the fabricated train run: checkpoints at 2 and 4


def train_run(root: Path, last_weight: float = 1.0) -> Path:
    """A finished 2-rank `hpref train` run folder as the chaos script reads it: metrics.jsonl, two
    real DCP checkpoints (index, shard, train_state.json, checksums.json) and `latest`."""
    import torch.distributed.checkpoint as dcp

    from hpref.runfolder.integrity import write_manifest

    run_dir = root / "runs" / "chaos-train"
    (run_dir / "checkpoints").mkdir(parents=True)
    rows = [{"kind": "train", "step": s, "step_loss": 1.0 / s} for s in range(1, STEPS + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, weight in ((2, 0.5), (STEPS, last_weight)):
        folder = run_dir / "checkpoints" / f"step-{step:06d}"
        dcp.save({"model.w": torch.full((4,), weight)}, checkpoint_id=str(folder), no_dist=True)
        state = {"step": step, "world_size": 2, "sampler": {}, "scheduler": {}, "lineage": {"id": str(root)}}
        (folder / "train_state.json").write_text(json.dumps(state))
        write_manifest(folder)
    (run_dir / "checkpoints" / "latest").write_text(f"step-{STEPS:06d}\n")
    return run_dir


def train_faults(run_dir: Path, ref_dir: Path) -> dict:
    """What `run_chaos` records for a rank and a launcher SIGKILL, each resumed from step 2."""
    after = chaos_train.checkpoint_state(run_dir, ref_dir)
    common = {"exit_code": -9, "after_fault": after, "resume_predicted": "step-000004"}
    common.update(resumed_from="step-000004", resume_launch="launch-n", logged_to=STEPS)
    faults = [{"kind": "rank", **common}, {"kind": "launcher", "orphans": [], **common}]
    return {"faults": faults, "final_exit_code": 0}


def test_chaos_train_verify_fails_a_run_that_compared_nothing(tmp_path):
    """No fault struck, no step logged, no checkpoint: every check that compares must fail and say
    what it did not compare. If this passes, the benchmark and the suite's chaos test report a run
    that never ran as bit-identical to its reference (`all()` over nothing is True)."""
    ref_dir, run_dir = tmp_path / "ref" / "runs" / "r", tmp_path / "chaos" / "runs" / "r"
    for d in (ref_dir, run_dir):
        d.mkdir(parents=True)
    checks = chaos_train.verify(
        tmp_path, ref_dir, run_dir, {"faults": [], "final_exit_code": 0}, 2, exports=False
    )
    failed = chaos_train.failures(checks)
    not_compared = {name for name, c in checks.items() if "not_compared" in c}
    assert {
        "every planned fault struck, in turn",
        "every step's loss identical to the reference's",
        "metrics.jsonl holds each step once",
        "the final checkpoint has the reference's bytes (weights, optimizer, RNG)",
        "resume picked the newest verified checkpoint",
        "latest names the newest verified checkpoint",
        "rank SIGKILL: the run ended non-zero",
        "launcher SIGKILL: no worker outlives it",
    } <= not_compared
    assert all(not checks[name]["ok"] for name in not_compared)
    assert any("compared nothing: no reference loss" in line for line in failed), failed
    # kinds not planned (2 faults: a rank and the launcher) are not judged: no ENOSPC check
    assert not any(name.startswith("ENOSPC") for name in checks)


def test_chaos_train_verify_fails_a_different_final_checkpoint_and_passes_a_match(tmp_path):
    """The same fabricated run twice passes every check; the chaos copy with one weight changed in
    its final checkpoint fails exactly the checkpoint checks. If the match fails, the comparison
    reads something run-specific (a save's own lineage id) as training state; if the difference
    passes, checkpoints are not compared at all."""
    ref_dir = train_run(tmp_path / "ref")
    same = train_run(tmp_path / "same")
    checks = chaos_train.verify(tmp_path, ref_dir, same, train_faults(same, ref_dir), 2, exports=False)
    assert chaos_train.failures(checks) == []
    assert checks["the final checkpoint has the reference's bytes (weights, optimizer, RNG)"]["compared"] == 1

    other = train_run(tmp_path / "other", last_weight=1.5)
    checks = chaos_train.verify(tmp_path, ref_dir, other, train_faults(other, ref_dir), 2, exports=False)
    failed = {line.split(": ")[1] for line in chaos_train.failures(checks)}
    assert failed == {
        "the final checkpoint has the reference's bytes (weights, optimizer, RNG)",
        "each checkpoint seen verifies (and has the reference's bytes where it kept the step)",
    }


def rl_run(work: Path, run: str, position: int, saved: bool = True, moment: float = 0.25) -> None:
    """A finished one-policy (`a`) `hpref rl` run as the chaos script reads it: record.json, the
    policy's metrics, its save at `position` (safetensors + trainer.pt's AdamW state) and the
    console line that names the save (left out with `saved=False`)."""
    from safetensors.torch import save_file

    run_dir = work / "runs" / run
    save = run_dir / "checkpoints" / f"rollout-{position:06d}" / "a"
    save.mkdir(parents=True)
    save_file({"w": torch.ones(3)}, str(save / "model.safetensors"))
    moments = {"step": torch.tensor(float(position)), "exp_avg": torch.full((3,), moment)}
    state = {"optimizer": {"state": {0: moments}}, "rollouts_done": position, "version": position}
    torch.save(state, save / "trainer.pt")
    record = {
        "rollout_ids": {"a": position},
        "save_dir": f"checkpoints/rollout-{position:06d}",
        "leader": "a",
    }
    (run_dir / "record.json").write_text(json.dumps(record))
    rows = [{"rollout": r, "weight_version": r + 1, "data_version": r, "loss": 0.1} for r in range(position)]
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "logs").mkdir(exist_ok=True)
    line = f"12:00:00 INFO    saved checkpoints/rollout-{position:06d}: a at rollout {position}\n"
    (work / "logs" / f"{run}-0.stderr").write_text(line if saved else "")


def rl_verdict(work: Path, kills: list[dict] | None = None) -> list[str]:
    args = argparse.Namespace(work=work, policies=["a"], rollouts=2)
    kills = [{"left_behind": [], "resumed_from": {"a": 1}}] if kills is None else kills
    checks = chaos_rl.check(args, kills)
    end = {"exit_code": 0, "message": "", "left_behind": []}
    return chaos_rl.failures({"kills": kills, "kills_asked": 1, "end": end, "checks": checks})


def test_chaos_rl_fails_a_run_with_no_save_both_runs_made(tmp_path):
    """The reference named no save of the policy's position and no kill struck: the verdict must
    say the final weights were not compared and the kills were not tried. If it passes, chaos_rl
    prints "final weights equal ... True" having compared nothing (`all()` over no policy)."""
    rl_run(tmp_path, "ref", 2, saved=False)
    rl_run(tmp_path, "chaos", 2)
    failed = rl_verdict(tmp_path, kills=[])
    assert "policy a: final weights not compared: no position of a saved by both runs" in failed
    assert any(line.startswith("0 kills of 1 asked struck") for line in failed), failed


def test_chaos_rl_fails_a_difference_and_an_empty_save_and_passes_a_match(tmp_path):
    """Equal saves pass (but not when the kill came after the last rollout); one AdamW moment
    different fails naming the tensor; saves with no tensor fail as not compared. If the difference
    passes, the optimizer state is not compared; if the empty saves pass, a save that lost its files
    would count as equal; if the late kill passes, a run whose resume ran nothing counts as tested."""
    rl_run(tmp_path / "same", "ref", 2)
    rl_run(tmp_path / "same", "chaos", 2)
    assert rl_verdict(tmp_path / "same") == []
    # a kill after the last rollout's save: its resume had nothing to do, so it tested nothing
    late = [{"left_behind": [], "resumed_from": {"a": 2}}]
    assert rl_verdict(tmp_path / "same", late) == [
        "kill 1: landed after the leader's last rollout (resumed at {'a': 2}): no resume tested"
    ]

    rl_run(tmp_path / "moment", "ref", 2)
    rl_run(tmp_path / "moment", "chaos", 2, moment=0.5)
    failed = rl_verdict(tmp_path / "moment")
    assert failed == [
        "policy a: final weights differ at position 2: 1 of 3 tensors, first trainer.pt:optimizer.0.exp_avg"
    ]

    for run in ("ref", "chaos"):
        rl_run(tmp_path / "empty", run, 2)
        save = tmp_path / "empty" / "runs" / run / "checkpoints" / "rollout-000002" / "a"
        (save / "model.safetensors").unlink()
        torch.save({"optimizer": {"state": {}}, "rollouts_done": 2, "version": 2}, save / "trainer.pt")
    failed = rl_verdict(tmp_path / "empty")
    assert any("final weights not compared: no tensor in" in line for line in failed), failed
