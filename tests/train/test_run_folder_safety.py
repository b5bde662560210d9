"""The issue's own scenario with real training: a second, shorter run in the same run folder.

Refused without `--overwrite`; with it, the folder ends holding only the new run. `summary.json` is
written atomically and durably by the trainer itself.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def test_every_file_of_a_run_folder_is_written_atomically_except_the_appended_logs(
    tmp_path, capsys, monkeypatch
):
    """README: files hpref owns are written to a temporary name, fsynced and renamed; the logs
    (`metrics.jsonl`, `logs/*.log`) are appended. A real run (checkpoints, evals with predictions,
    summary, recipe): every file in the folder is either renamed into
    place from a fsynced temporary file, inside a checkpoint folder that was renamed into place
    after its files were fsynced, or one of the appended logs. A new file written in place would
    fail here, naming it, before the README's sentence stops being true."""
    recipe = write_recipe(tmp_path)
    spy = DurableWrites(monkeypatch)
    code, err = _train(capsys, recipe, "--set", "train.max_steps=3", "--set", "train.checkpoint_interval=2")
    assert code == 0, err
    run_dir = (tmp_path / "runs" / "run").resolve()
    appended, checked = [], []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(run_dir)
        if rel.parts[0] == "logs" or rel.name == "metrics.jsonl":
            appended.append(str(rel))
        elif rel.parts[0] == CHECKPOINTS and len(rel.parts) > 2:
            folder = run_dir / rel.parts[0] / rel.parts[1]
            sources = [src for src, dst in spy.renamed if dst == folder]
            assert sources, f"{folder} was not renamed into place"
            inside = sources[-1] / Path(*rel.parts[2:])  # the file under the temporary folder's name
            written = [src for src, dst in spy.renamed if dst == inside]  # atomically, there
            synced = inside in spy.fsynced or (written and written[-1] in spy.fsynced)
            assert synced, f"{rel}: not fsynced before the folder's rename"
        else:
            spy.assert_durable(path)
            checked.append(str(rel))
    assert appended == ["logs/rank0.log", "metrics.jsonl"]
    # what the run wrote atomically: the README's list, each one present
    assert {"recipe.toml", "summary.json", "predictions.csv", "checkpoints/latest"} <= set(checked)
    assert any(c.startswith("predictions/step-") for c in checked)


def test_an_appended_log_cut_by_a_crash_loses_only_its_last_line(tmp_path, monkeypatch):
    """`metrics.jsonl` is appended a line at a time: a crash mid-append leaves a cut last line,
    which readers drop (a resume must not fail on it), while a bad line elsewhere is still an
    error; the resume's rewrite up to the checkpoint's step is atomic and durable."""
    from hpref.train.metrics import MetricsFile, read_metrics

    path = tmp_path / "metrics.jsonl"
    metrics = MetricsFile(path)
    for step in (1, 2, 3):
        metrics.write({"kind": "train", "step": step})
    with open(path, "a") as fh:
        fh.write('{"kind": "train", "st')  # the crash
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    spy = DurableWrites(monkeypatch)
    metrics.start(resumed_step=2)
    spy.assert_durable(path)
    assert path.read_text().splitlines() == [json.dumps({"kind": "train", "step": s}) for s in (1, 2)]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(json.JSONDecodeError):
        read_metrics(path)
