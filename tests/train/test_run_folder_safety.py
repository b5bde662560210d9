"""The issue's own scenario with real training: a second, shorter run in the same run folder.

Refused without `--overwrite`; with it, the folder ends holding only the new run. `summary.json` is
written atomically and durably by the trainer itself.
"""

from __future__ import annotations

import json

import pytest

from hpref.train.checkpoint import CHECKPOINTS, LATEST
from tests.durable import DurableWrites

from .conftest import write_recipe


def _train(capsys, recipe, *args):
    from hpref.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(recipe), "--nproc-per-node", "1", *args])
    return exit_info.value.code, capsys.readouterr().err


def test_a_second_run_in_the_same_folder_is_refused_or_replaces_the_first_whole(
    tmp_path, capsys, monkeypatch
):
    """First run: 4 steps, a checkpoint every step, keep 2 (steps 3 and 4 stay). A fresh 2-step run
    in the same folder is refused (one line, exit 2); with --overwrite it runs and the folder holds
    exactly its checkpoints (1, 2), `latest` names step 2, and metrics.jsonl holds steps 1-2 only.
    If this fails, the old run's higher steps survive pruning and delete the new run's checkpoints,
    `latest` points at a deleted folder and `hpref save` exports the old weights."""
    recipe = write_recipe(tmp_path)
    common = [
        "--set",
        "train.checkpoint_interval=1",
        "--set",
        "train.eval_interval=0",
        "--set",
        "train.eval_steps=0",
    ]
    code, err = _train(capsys, recipe, *common, "--set", "train.max_steps=4")
    assert code == 0, err
    run_dir = tmp_path / "runs" / "run"
    user_file = run_dir / "notes.md"
    user_file.write_text("mine")
    assert sorted(p.name for p in (run_dir / CHECKPOINTS).glob("step-*")) == ["step-000003", "step-000004"]

    code, err = _train(capsys, recipe, *common, "--set", "train.max_steps=2")
    assert code == 2
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "already holds a run" in line and "--overwrite" in line

    spy = DurableWrites(monkeypatch)
    code, err = _train(capsys, recipe, *common, "--set", "train.max_steps=2", "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in (run_dir / CHECKPOINTS).glob("step-*")) == ["step-000001", "step-000002"]
    assert (run_dir / CHECKPOINTS / LATEST).read_text().strip() == "step-000002"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 2
    assert user_file.read_text() == "mine"
    spy.assert_durable(run_dir / "summary.json")
    spy.assert_durable(run_dir / "recipe.toml")
