"""Nothing lost: a fresh `hpref train` never lands on another run, `--overwrite` deletes only what
hpref wrote, a run folder that is a file is one line, and the files hpref owns are written atomically.

`hpref train` is called through the real CLI (`hpref.cli.main`, in-process) with the launcher
replaced by a recorder, so each test shows what happens *before* any process would start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import textwrap
import time

import pytest

from hpref.runfolder import layout
from tests.conftest import run_hpref
from tests.durable import DurableWrites

RECIPE = textwrap.dedent(
    """
    [run]
    name = "r"
    output_dir = "{output_dir}"
    [model]
    name = "tiny-llama"
    hidden_size = 32
    [dataset.train]
    name = "synthetic-arena"
    num_battles = 50
    """
)


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(RECIPE.format(output_dir=(tmp_path / "runs").as_posix()))
    return path


@pytest.fixture
def launches(monkeypatch):
    """Every call that would have started training, instead of training."""
    import hpref.train.launch

    calls: list[dict] = []

    def fake_launch_train(request, recipe=None):
        calls.append({"recipe": request.recipe_path, **dataclasses.asdict(request)})
        return 0

    monkeypatch.setattr(hpref.train.launch, "launch_train", fake_launch_train)
    return calls


def hpref(capsys, *args: str) -> tuple[int, str]:
    """Run the CLI in-process; returns (exit code, stderr)."""
    from hpref.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code, capsys.readouterr().err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def old_run(run_dir):
    """What a finished run leaves, plus temporaries of killed writes, plus the user's own things."""
    (run_dir / "checkpoints" / "step-000040").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-000040" / ".metadata").write_bytes(b"x")
    (run_dir / "checkpoints" / "latest").write_text("step-000040\n")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 40}\n')
    (run_dir / "summary.json").write_text("{}\n")
    (run_dir / "recipe.toml").write_text("# old\n")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank0.log").write_text("old log\n")
    (run_dir / "predictions").mkdir()
    (run_dir / "predictions" / "step-000040.csv").write_text("id\n")
    (run_dir / "predictions.csv").write_text("id\n")
    (run_dir / ".summary.json.4242.part").write_text("half")
    (run_dir / "metrics.jsonl.tmp").write_text("half")
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "predictions.csv").write_text("id\n")
    (run_dir / "eval" / "predictions.metrics.json").write_text("{}")
    # the user's
    (run_dir / "notes.md").write_text("my notes")
    (run_dir / "analysis").mkdir()
    (run_dir / "analysis" / "plot.py").write_text("print()")
    (run_dir / "eval" / "mine.csv").write_text("mine")
    (run_dir / "export").mkdir()
    (run_dir / "export" / "hpref_checkpoint.json").write_text("{}")
    (run_dir / "init").mkdir()
    (run_dir / "init" / "model.safetensors").write_bytes(b"init weights")


USER_FILES = (
    "notes.md",
    "analysis/plot.py",
    "eval/mine.csv",
    "export/hpref_checkpoint.json",
    "init/model.safetensors",
)


def tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_fresh_train_into_a_folder_holding_a_run_is_refused(recipe, tmp_path, launches, capsys):
    """A fresh run in a folder that holds a run is refused in one line naming the three ways out,
    and nothing is touched. If this fails, a new run starts on top of the old one: keep-N pruning
    deletes the new run's checkpoints (the old run's higher steps sort last), `latest` points at a
    deleted folder and `hpref save` exports the old weights under the new recipe."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    old_run(run_dir)
    before = tree(run_dir)
    code, err = hpref(capsys, "train", str(recipe))
    assert code == 2 and not launches
    (line,) = error_lines(err)
    assert "already holds a run" in line and "checkpoints/" in line
    assert "--resume auto" in line and "run.name" in line and "--overwrite" in line
    assert tree(run_dir) == before


@pytest.mark.parametrize("marker", ["metrics.jsonl", "summary.json", "checkpoints/step-000001/x"])
def test_any_trace_of_a_started_run_counts(recipe, tmp_path, launches, capsys, marker):
    """Each file a started run leaves is enough to refuse; otherwise a run that crashed before its
    first checkpoint (metrics.jsonl only) would be overwritten silently."""
    path = tmp_path / "runs" / "r" / marker
    path.parent.mkdir(parents=True)
    path.write_text("x")
    code, _ = hpref(capsys, "train", str(recipe))
    assert code == 2 and not launches


def test_init_weights_logs_and_resume_are_not_refused(recipe, tmp_path, launches, capsys):
    """`hpref init` (init/ + recipe.toml) and a start that failed in set-up (logs/ only) hold no run:
    training must start. `--resume auto` continues a run, so it is never refused either. If this
    fails, the check blocks the documented `hpref init` -> `hpref train` flow or resuming."""
    run_dir = tmp_path / "runs" / "r"
    (run_dir / "init").mkdir(parents=True)
    (run_dir / "recipe.toml").write_text("# from hpref init\n")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank0.log").write_text("failed in set-up\n")
    (run_dir / "checkpoints").mkdir()  # empty: nothing to lose
    assert hpref(capsys, "train", str(recipe))[0] == 0
    (run_dir / "metrics.jsonl").write_text("{}\n")
    assert hpref(capsys, "train", str(recipe), "--resume", "auto")[0] == 0
    assert len(launches) == 2 and launches[1]["resume"] == "auto"
    assert (run_dir / "init").is_dir() and (run_dir / "metrics.jsonl").exists()


def test_overwrite_deletes_only_what_hpref_wrote(recipe, tmp_path, launches, capsys):
    """`--overwrite` removes the old run (checkpoints, metrics, summary, recipe, logs, predictions,
    temporaries of killed writes, the default eval outputs) and keeps everything else: the user's
    notes and folders, an export, `init/` (the weights this run starts from). If this fails,
    --overwrite either leaves the old run to corrupt the new one or deletes what hpref did not write."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    old_run(run_dir)
    code, err = hpref(capsys, "train", str(recipe), "--overwrite")
    assert code == 0 and len(launches) == 1, err
    assert tree(run_dir) == sorted(["analysis", "eval", "export", "init", *USER_FILES]), (
        "left or deleted the wrong entries"
    )
    assert (run_dir / "notes.md").read_text() == "my notes"


def test_overwrite_refuses_a_run_that_is_still_training(recipe, tmp_path, launches, capsys):
    """A fresh heartbeat from a live process means a trainer is writing there now: deleting its
    folder under it would corrupt both runs. If this fails, --overwrite deletes a live run."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    old_run(run_dir)
    beat = {"pid": os.getpid(), "host": socket.gethostname(), "step": 3, "time": time.time()}
    (run_dir / "heartbeat.json").write_text(json.dumps(beat))
    before = tree(run_dir)
    code, err = hpref(capsys, "train", str(recipe), "--overwrite")
    assert code == 2 and not launches
    (line,) = error_lines(err)
    assert "still training" in line
    assert tree(run_dir) == before


def test_overwrite_with_resume_is_a_contradiction(recipe, tmp_path, launches, capsys):
    code, err = hpref(capsys, "train", str(recipe), "--overwrite", "--resume", "auto")
    assert code == 2 and not launches and "--overwrite" in error_lines(err)[0]


def test_output_dir_that_is_a_file_is_one_line_before_any_process(tmp_path, launches, capsys):
    """`run.output_dir` naming an existing file: one line, exit 2, nothing launched. If this fails,
    each worker dies with NotADirectoryError (or a traceback per rank) after start-up."""
    blocker = tmp_path / "runs"
    blocker.write_text("I am a file")
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(output_dir=blocker.as_posix()))
    code, err = hpref(capsys, "train", str(recipe))
    assert code == 2 and not launches
    (line,) = error_lines(err)
    assert str(blocker) in line and "is a file" in line
    assert blocker.read_text() == "I am a file"


def test_output_dir_that_is_a_file_through_the_real_command(tmp_path):
    """The same through the console script and the real launcher (1 and 2 ranks): one stderr line,
    exit 2, no traceback from any worker."""
    blocker = tmp_path / "runs"
    blocker.write_text("I am a file")
    recipe = tmp_path / "r.toml"
    recipe.write_text(RECIPE.format(output_dir=blocker.as_posix()))
    for nproc in ("1", "2"):
        result = run_hpref("train", str(recipe), "--nproc-per-node", nproc, timeout=300)
        assert result.returncode == 2, result.stderr[-2000:]
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and "is a file" in lines[0], result.stderr


def test_owner_of_tells_a_run_s_own_entries_from_new_names_inside_it(tmp_path):
    """Outputs may go to new names inside a run folder (`RUN/export`, `hpref eval`'s `RUN/eval/`)
    but never into a run's own entries or a checkpoint. If this fails, an export or a predictions
    file lands where pruning or `--overwrite` deletes it, or corrupts a checkpoint."""
    run_dir = tmp_path / "r"
    old_run(run_dir)
    checkpoint = run_dir / "checkpoints" / "step-000040"
    assert layout.owner_of(run_dir / "export") is None
    assert layout.owner_of(run_dir / "eval" / "predictions.csv") is None
    assert layout.owner_of(tmp_path / "elsewhere" / "x.csv") is None
    for owned in (
        run_dir / "checkpoints",
        checkpoint / "p.csv",
        run_dir / "summary.json",
        run_dir / "logs" / "x",
        run_dir / "predictions" / "x.csv",
    ):
        assert layout.owner_of(owned) is not None, owned
    copied = tmp_path / "downloaded-checkpoint"
    copied.mkdir()
    (copied / ".metadata").write_bytes(b"x")
    assert "checkpoint" in layout.owner_of(copied / "sub" / "p.csv")


def test_side_files_are_named_after_the_output():
    assert [p.name for p in layout.side_files("d/x.csv")] == ["x.metrics.json", "x.reliability.png"]
    assert [p.name for p in layout.side_files("d/a.v2.jsonl")] == [
        "a.v2.metrics.json",
        "a.v2.reliability.png",
    ]


def test_recipe_toml_is_written_atomically_and_durably(tmp_path, monkeypatch):
    """`recipe.toml` is what export and eval rebuild the model from. If this fails, it is written in
    place: a crash mid-write leaves half a recipe under the real name."""
    from hpref.recipe import recipe_from_dict

    recipe = recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}})
    spy = DurableWrites(monkeypatch)
    path = recipe.write(tmp_path / "r")
    spy.assert_durable(path)
    assert "[run]" in path.read_text()


def test_a_write_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A failure at the last moment (disk full at the rename) keeps the previous `recipe.toml`
    whole and leaves no temporary beside it. If this fails, the old recipe is lost or a stray
    temporary file is left in the run folder."""
    from hpref.recipe import recipe_from_dict

    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "recipe.toml").write_text("# the old recipe\n")

    def full_disk(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    recipe = recipe_from_dict({"run": {"name": "r", "output_dir": str(tmp_path)}})
    with pytest.raises(OSError):
        recipe.write(folder)
    assert (folder / "recipe.toml").read_text() == "# the old recipe\n"
    assert os.listdir(folder) == ["recipe.toml"]
