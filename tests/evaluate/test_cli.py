"""The eval/save command bodies end to end on a tiny run: files written, numbers consistent."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from hpref.arena import generate_battles
from hpref.data.readers import ArenaConfig, ArenaReader, write_arena_file
from hpref.errors import UserError
from hpref.evaluate.command import EvalRequest, eval_command
from hpref.prediction.files import read_predictions
from hpref.prediction.metrics import log_loss
from hpref.save.command import SaveRequest, save_command

from .conftest import make_run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_eval_save_ensemble_and_soft_labels(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    make_run(run_dir)
    recipe = run_dir / "recipe.toml"
    battles = list(generate_battles(24, seed=11))
    labelled = write_arena_file(tmp_path / "eval.csv", battles)

    # a checkpoint, with swap TTA
    assert (
        eval_command(
            EvalRequest(recipe, checkpoint=run_dir, data=labelled, out=tmp_path / "a" / "p.csv", tta="swap")
        )
        == 0
    )
    metrics = json.loads((tmp_path / "a" / "p.metrics.json").read_text())
    preds = read_predictions(tmp_path / "a" / "p.csv")
    labels = np.array([b.label for b in battles])
    assert metrics["n"] == 24 and metrics["log_loss"] == pytest.approx(log_loss(preds.probs, labels))
    assert metrics["sequences"] == 48 and metrics["rows_per_s"] > 0 and metrics["bayes_floor"] is not None
    assert (tmp_path / "a" / "p.reliability.png").read_bytes()[:4] == b"\x89PNG"
    assert "rows/s" in capsys.readouterr().out

    # export, then the same eval on the export (no TTA) and an ensemble of the two files
    assert save_command(SaveRequest(run_dir, to=tmp_path / "export")) == 0
    assert (
        eval_command(
            EvalRequest(recipe, checkpoint=tmp_path / "export", data=labelled, out=tmp_path / "b" / "p.csv")
        )
        == 0
    )
    b = read_predictions(tmp_path / "b" / "p.csv")
    out = tmp_path / "c" / "blend.csv"
    files = [tmp_path / "a" / "p.csv", tmp_path / "b" / "p.csv"]
    assert eval_command(EvalRequest(None, ensemble=files, weights="1,1", data=labelled, out=out)) == 0
    np.testing.assert_allclose(read_predictions(out).probs, (preds.probs + b.probs) / 2, atol=1e-12)
    assert json.loads((tmp_path / "c" / "blend.metrics.json").read_text())["weights"] == [0.5, 0.5]
    assert (
        eval_command(
            EvalRequest(None, ensemble=files, fit_weights=True, data=labelled, out=tmp_path / "d" / "f.csv")
        )
        == 0
    )
    fitted = json.loads((tmp_path / "d" / "f.metrics.json").read_text())
    assert fitted["log_loss"] <= min(metrics["log_loss"], log_loss(b.probs, labels)) + 1e-9

    # teacher predictions on unlabelled battles -> soft labels the arena reader accepts
    unlabelled = write_arena_file(
        tmp_path / "test.csv", [dataclasses.replace(x, label=None) for x in battles]
    )
    soft = tmp_path / "soft.csv"
    assert (
        eval_command(
            EvalRequest(None, ensemble=files, data=unlabelled, out=tmp_path / "e" / "t.csv", soft_labels=soft)
        )
        == 0
    )
    assert not (tmp_path / "e" / "t.metrics.json").exists()  # nothing to score without labels
    students = list(ArenaReader(ArenaConfig(path=str(soft)), seed=0).battles())
    np.testing.assert_allclose(
        [s.label for s in students], read_predictions(tmp_path / "e" / "t.csv").probs, atol=1e-12
    )


def test_usage_errors():
    with pytest.raises(UserError, match="--tta 'flip'"):
        eval_command(EvalRequest(None, tta="flip"))
    with pytest.raises(UserError, match="RECIPE and --checkpoint"):
        eval_command(EvalRequest(None))
    with pytest.raises(UserError, match="--to DIR"):
        save_command(SaveRequest("/nonexistent"))


def test_two_process_eval_gives_the_one_process_predictions(tmp_path):
    """`--nproc-per-node 2` starts two torchrun ranks that each score part of the battles and
    gather them. If ids go missing, repeat, or probabilities differ from a one-process eval, the
    split or the gather is wrong."""
    import subprocess
    import sys

    run_dir = tmp_path / "runs" / "tiny"
    make_run(run_dir)
    recipe = run_dir / "recipe.toml"
    labelled = write_arena_file(tmp_path / "eval.csv", list(generate_battles(30, seed=5)))
    assert (
        eval_command(
            EvalRequest(recipe, checkpoint=run_dir, data=labelled, out=tmp_path / "one" / "p.csv", plot=False)
        )
        == 0
    )
    result = subprocess.run(
        [sys.executable, "-m", "hpref", "eval", str(recipe), "--checkpoint", str(run_dir),
         "--data", str(labelled), "--out", str(tmp_path / "two" / "p.csv"), "--no-plot",
         "--nproc-per-node", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size" in result.stdout and "eval throughput" in result.stdout
    one = read_predictions(tmp_path / "one" / "p.csv")
    two = read_predictions(tmp_path / "two" / "p.csv")
    assert sorted(one.ids) == sorted(two.ids) and len(two.ids) == 30
    order = {i: k for k, i in enumerate(two.ids)}
    two_probs = two.probs[[order[i] for i in one.ids]]
    assert np.abs(two_probs - one.probs).max() < 1e-5
    metrics = json.loads((tmp_path / "two" / "p.metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["n"] == 30


def test_teacher_predicts_then_student_trains_on_soft_labels(tmp_path):
    """Distillation in two commands: `hpref eval --soft-labels` on unlabelled battles, then
    `hpref train` on that file. If the student's training data are not the teacher's
    probabilities (hard labels, dropped rows), the file or the reader loses the soft labels."""
    from hpref.train import run_train
    from hpref.train.metrics import read_metrics

    run_dir = tmp_path / "runs" / "tiny"
    make_run(run_dir)
    teacher = tmp_path / "teacher.csv"
    unlabelled = write_arena_file(
        tmp_path / "test.csv", [dataclasses.replace(b, label=None) for b in generate_battles(40, seed=3)]
    )
    soft = tmp_path / "soft.parquet"
    assert (
        eval_command(EvalRequest(run_dir / "recipe.toml", checkpoint=run_dir, data=unlabelled, out=teacher))
        == 0
    )
    assert (
        eval_command(
            EvalRequest(None, ensemble=[teacher], data=unlabelled, out=tmp_path / "e.csv", soft_labels=soft)
        )
        == 0
    )

    import tomllib

    from hpref.recipe import dump_toml

    data = tomllib.loads((run_dir / "recipe.toml").read_text())  # the teacher's model and formatter
    data["run"] = {"name": "student", "output_dir": (tmp_path / "runs").as_posix()}
    data["dataset"] = {"train": {"name": "arena", "path": soft.as_posix()}}
    data["train"].update(epochs=1, batch_size=8, precision="fp32", log_interval=1, eval_interval=0)
    student = tmp_path / "student.toml"
    student.write_text(dump_toml(data))
    assert run_train(student) == 0
    rows = [r for r in read_metrics(tmp_path / "runs" / "student" / "metrics.jsonl") if r["kind"] == "train"]
    assert len(rows) == 5  # 40 battles (no swap in this recipe), 8 per step: every row trained on
    students = list(ArenaReader(ArenaConfig(path=str(soft)), seed=0).battles())
    assert all(max(s.label) < 1.0 for s in students)  # soft, not one-hot
