"""`hpref save RL_RUN --policy ID`'s refusals: each one line, exit 2, before a weight is read and
with nothing written at `--to`. The run folder is laid out as `hpref rl` leaves it (rl.json, the
record, each global save's parts with their checksums), without weights: a refusal that came after
loading would fail here on the missing weights instead.

Exports of real runs, loaded by transformers and vLLM and compared with the runs' recorded greedy
answers, are in test_real_model.py (SmolLM2 LoRA), test_vllm_engine.py (a full fine-tune on vLLM)
and test_shared_base.py (adapters of a shared base)."""

from __future__ import annotations

import json

import pytest

from hpref.runfolder.integrity import write_manifest
from hpref.runfolder.record import CheckpointRecord, write_record
from tests.conftest import run_hpref_here
from tests.rl.tiny import TINY


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Policies a (a full fine-tune: `model/`) and b (a tiny LoRA: `policy_base.json`), saved at
    rollouts 1 and 2 (the record names 2), and a save at 3 that died before its executor part."""
    run = tmp_path_factory.mktemp("rl") / "run"
    config = {"policies": {"a": {"model": TINY}, "b": {"model": TINY, "lora": {"r": 4}}}}
    run.mkdir()
    (run / "rl.json").write_text(
        json.dumps({"policies": ["a", "b"], "warmup_checkpoints": {}, "config": config})
    )
    for n in (1, 2, 3):
        save = run / "checkpoints" / f"rollout-{n:06d}"
        (save / "a" / "model").mkdir(parents=True)
        (save / "a" / "model" / "config.json").write_text("{}")
        (save / "a" / "trainer.pt").write_bytes(b"trainer state")
        (save / "b").mkdir()
        (save / "b" / "policy_base.json").write_text(
            json.dumps({"format": 1, "base": TINY, "lora": {"r": 4}})
        )
        parts = ["a", "b"]
        if n < 3:
            (save / "executor").mkdir()
            (save / "executor" / "executor.json").write_text(json.dumps({"positions": {"a": n, "b": n}}))
            parts.append("executor")
        for part in parts:
            write_manifest(save / part)
    write_record(run, CheckpointRecord("a", {"a": 2, "b": 2}, save_dir="checkpoints/rollout-000002"))
    return run


def refused(tmp_path, *args):
    """The last line of `hpref save ARGS --to DIR`, which must be refused (exit 2, no traceback, no DIR)."""
    to = tmp_path / "export"
    result = run_hpref_here("save", *map(str, args), "--to", str(to))
    assert result.returncode == 2, result.stderr[-1500:]
    assert "Traceback" not in result.stderr and not to.exists()
    return result.stderr.strip().splitlines()[-1]


def test_an_rl_run_exports_one_policy_it_has(run_dir, tmp_path):
    # Wrong if an rl run without --policy, or with a policy it never trained, got past the command
    # (a traceback, or an export of the wrong thing) instead of one line naming the run's policies.
    line = refused(tmp_path, run_dir)
    assert "--policy" in line and "its policies: a, b" in line
    line = refused(tmp_path, run_dir, "--policy", "b1")
    assert "no such policy (did you mean 'b'?); its policies: a, b" in line


def test_policy_on_a_train_run_is_refused(tmp_path):
    # Wrong if --policy were ignored on a train run (exporting its preference model as if asked).
    step = tmp_path / "train" / "checkpoints" / "step-000001"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "train_state.json").write_text("{}")
    line = refused(tmp_path, tmp_path / "train", "--policy", "a")
    assert "is not an hpref rl run" in line and "export a train run without it" in line


def test_a_save_that_is_not_there_or_not_whole_is_refused(run_dir, tmp_path):
    # Wrong if --step named a save that was pruned, never made, or died half way, and the export
    # read it anyway (or failed without saying which saves there are).
    line = refused(tmp_path, run_dir, "--policy", "a", "--step", "rollout-5")
    assert (
        "no save at rollout 5 (rollout-000005 does not exist); its saves: rollout-000001, rollout-000002"
        in line
    )
    line = refused(tmp_path, run_dir, "--policy", "a", "--step", "3")
    assert "rollout-000003 did not finish" in line
    assert "expected latest, rollout-N" in refused(tmp_path, run_dir, "--policy", "a", "--step", "last")


def test_adapter_needs_an_adapter_and_a_base_folder(run_dir, tmp_path):
    # Wrong if --adapter on a full fine-tune, or on an adapter of a tiny random-init base (no folder
    # for adapter_config.json to name), wrote a folder nobody can load. A save folder named directly
    # is that save (rollout 1 here, not the record's).
    save = run_dir / "checkpoints" / "rollout-000001"
    assert "policy 'a' trained all its weights" in refused(tmp_path, save, "--policy", "a", "--adapter")
    assert "adapts a tiny random-init model" in refused(tmp_path, run_dir, "--policy", "b", "--adapter")


def test_a_damaged_save_is_refused_before_it_loads(run_dir, tmp_path):
    # Wrong if a save whose bytes changed since the trainer wrote them (a cut copy, a flipped
    # block, a swapped file) were loaded: the checksums written at save time must refuse it.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    (copy / "checkpoints" / "rollout-000002" / "a" / "trainer.pt").write_bytes(b"trainer stat")
    assert "checkpoint does not verify" in refused(tmp_path, copy, "--policy", "a")
    (copy / "checkpoints" / "rollout-000002" / "b" / "policy_base.json").write_text("{")
    write_manifest(copy / "checkpoints" / "rollout-000002" / "b")
    assert "policy_base.json: damaged" in refused(tmp_path, copy, "--policy", "b")
