"""Where `hpref save` and `hpref eval` may write, and what they may replace: never the run or
checkpoint being read, never a folder or file hpref did not write, never a temporary left behind;
and a recipe found inside a loaded folder never turns on remote code."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from hpref.arena import generate_battles
from hpref.data.readers import write_arena_file
from hpref.errors import UserError
from hpref.evaluate.command import EvalRequest, eval_command
from hpref.prediction.files import write_predictions
from hpref.recipe import remote_code_keys
from hpref.save import export
from tests.durable import DurableWrites

from .conftest import make_run

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    os.environ["HPREF_CACHE"] = str(tmp_path_factory.getbasetemp() / "hpref-cache")
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    make_run(run_dir)
    return run_dir


def snapshot(folder):
    """Every path under `folder` with its bytes (folders as None)."""
    return {
        str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes())
        for p in sorted(folder.rglob("*"))
    }


def cli(capsys, *args):
    from hpref.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    err = capsys.readouterr().err
    return exit_info.value.code, [line for line in err.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------------------------------
# hpref save --to


def test_save_to_the_run_itself_is_refused_and_the_run_survives(run, tmp_path, capsys):
    """`hpref save RUN --to RUN --overwrite` deleted the whole run. Refused (one line, exit 2) for
    the run, a folder containing it, its checkpoint and anything inside its own entries. If this
    fails, an export deletes or corrupts the run it is exported from."""
    before = snapshot(run)
    checkpoint = run / "checkpoints" / "step-000007"
    for target in (run, run.parent, checkpoint, checkpoint / "export", run / "checkpoints" / "export"):
        code, errors = cli(capsys, "save", str(run), "--to", str(target), "--overwrite")
        assert code == 2 and len(errors) == 1, (target, errors)
        assert str(target) in errors[0]
        code, errors = cli(capsys, "save", str(checkpoint), "--to", str(target), "--overwrite")
        assert code == 2 and len(errors) == 1, (target, errors)
    assert snapshot(run) == before
    assert sorted(os.listdir(run.parent)) == ["tiny"]  # no temporary folder beside the run


def test_overwrite_replaces_only_an_earlier_export(run, tmp_path):
    """`--overwrite` replaces a folder that is itself an hpref export (it has hpref_checkpoint.json)
    and nothing else: a folder with other content is refused, even with --overwrite, and kept byte
    for byte. If this fails, --overwrite deletes the user's files."""
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "thesis.tex").write_text("years of work")
    before = snapshot(mine)
    with pytest.raises(UserError, match="not an hpref export") as info:
        export.save_export(run, mine, overwrite=True)
    assert "\n" not in str(info.value)
    assert snapshot(mine) == before

    out = export.save_export(run, tmp_path / "export")
    (out / "stale.txt").write_text("from the earlier export")
    with pytest.raises(UserError, match="pass --overwrite"):
        export.save_export(run, out)
    export.save_export(run, out, overwrite=True)
    assert (out / export.CHECKPOINT_JSON).is_file() and not (out / "stale.txt").exists()
    assert sorted(os.listdir(tmp_path)) == ["export", "mine"]  # nothing moved aside is left


def test_an_export_inside_the_run_folder_under_a_new_name_is_allowed(run):
    """The README's `hpref save runs/quickstart --to runs/quickstart/export`: a new name of the
    user's choosing inside the run folder is not the run's own data. If this fails, the documented
    command (and the RL judge example built on it) stops working."""
    out = export.save_export(run, run / "export")
    try:
        assert (out / export.CHECKPOINT_JSON).is_file()
        assert sorted(os.listdir(run)) == ["checkpoints", "export", "recipe.toml"]
    finally:
        shutil.rmtree(out)


def test_save_to_a_file_is_one_line_and_leaves_no_temporary(run, tmp_path, capsys):
    """`--to FILE` (with or without --overwrite, or a path under a file) is one line, exit 2; the
    file is untouched and nothing is left in its folder. If this fails, save crashes with a
    traceback and leaves a temporary folder, or replaces the file."""
    target = tmp_path / "model.bin"
    target.write_bytes(b"precious")
    for args in ((), ("--overwrite",)):
        for to in (target, target / "sub"):
            code, errors = cli(capsys, "save", str(run), "--to", str(to), *args)
            assert code == 2 and len(errors) == 1 and "is a file" in errors[0], errors
    assert sorted(os.listdir(tmp_path)) == ["model.bin"] and target.read_bytes() == b"precious"


def test_a_save_that_fails_half_way_leaves_the_folder_as_it_was(run, tmp_path, monkeypatch):
    """A failure while the export is being written (disk full in the weights) removes the partial
    folder; an earlier export at --to is kept whole, and a user's folder named like the old fixed
    temporary (`.tmp-export`) is never deleted. If this fails, a failed save leaves debris or
    destroys the previous export or a user's folder."""
    from hpref.models.preference import PreferenceModel

    out = export.save_export(run, tmp_path / "export")
    (tmp_path / ".tmp-export").mkdir()
    (tmp_path / ".tmp-export" / "keep").write_text("the user's")
    before = snapshot(tmp_path)

    def full_disk(self, folder, state_dict=None):
        (folder / "model.safetensors").write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreferenceModel, "save_pretrained", full_disk)
    with pytest.raises(OSError, match="No space"):
        export.save_export(run, out, overwrite=True)
    assert snapshot(tmp_path) == before


def test_export_files_are_written_durably(run, tmp_path, monkeypatch):
    """The export's own files are fsynced and the folder appears by one rename. If this fails, a
    crash right after `hpref save` can leave an export folder with empty or missing files."""
    spy = DurableWrites(monkeypatch)
    out = export.save_export(run, tmp_path / "export")
    for name in (export.CHECKPOINT_JSON, export.MODEL_CARD, "model.safetensors", "config.json"):
        assert any(p.name == name for p in spy.fsynced), f"{name} was never fsynced"
    assert out.resolve().parent in spy.fsynced, "the rename into place was not made durable"


# --------------------------------------------------------------------------------------------------
# remote code


def _hostile_recipe(run_dir, where="model"):
    """The run's recipe.toml, edited by someone else to run the model folder's own Python code."""
    text = (run_dir / "recipe.toml").read_text()
    if where == "model":
        head, _, rest = text.partition("[model]")
        body, sep, tail = rest.partition("\n[")
        text = (
            head
            + '[model]\nname = "hf-classifier"\npath = "somewhere"\ntrust_remote_code = true\n'
            + sep
            + tail
        )
    (run_dir / "recipe.toml").write_text(text)


def test_a_run_folder_recipe_may_not_turn_on_remote_code(tmp_path, capsys):
    """`hpref save RUN` without --recipe reads RUN/recipe.toml; `trust_remote_code = true` there
    would run whatever Python the model folder holds. Refused in one line naming the file and the
    key and the way to accept it (--recipe), before any model is built. If this fails, a folder
    someone hands you can run code on your machine through `hpref save` or `hpref eval`."""
    from hpref.evaluate.runner import load_model

    run_dir = tmp_path / "downloaded"
    make_run(run_dir)
    _hostile_recipe(run_dir)
    code, errors = cli(capsys, "save", str(run_dir), "--to", str(tmp_path / "out"))
    assert code == 2 and len(errors) == 1, errors
    assert str(run_dir / "recipe.toml") in errors[0] and "model.trust_remote_code" in errors[0]
    assert "--recipe" in errors[0]
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="model.trust_remote_code"):
        load_model(run_dir)  # the eval path: a checkpoint without an explicit recipe


def test_remote_code_is_found_at_any_depth():
    """Any component can carry the flag (a policy's model under [rl], a plugin's table). If this
    fails, a nested `trust_remote_code` slips past the check."""
    data = {
        "model": {"name": "tiny-llama"},
        "rl": {"policies": {"a": {"model": {"trust_remote_code": True}}, "b": {"model": {}}}},
        "x": [{"trust_remote_code": "true"}, {"trust_remote_code": False}],
    }
    assert remote_code_keys(data) == ["rl.policies.a.model.trust_remote_code", "x.0.trust_remote_code"]


# --------------------------------------------------------------------------------------------------
# hpref eval --out


@pytest.fixture
def blend_inputs(tmp_path):
    """Two prediction files and labelled battles: an ensemble eval needs no model."""
    battles = list(generate_battles(20, seed=3))
    data = write_arena_file(tmp_path / "battles.csv", battles)
    rng = np.random.default_rng(0)
    files = []
    for name in ("a.csv", "b.csv"):
        probs = rng.dirichlet([1, 1, 1], size=len(battles))
        files.append(write_predictions(tmp_path / name, [b.id for b in battles], probs))
    return files, data


def test_eval_never_replaces_files_it_did_not_write_for_this_output(tmp_path, blend_inputs):
    """`hpref eval --out DIR/x.csv` wrote `DIR/metrics.json` and `DIR/reliability.png`, replacing
    whatever had those names (another evaluation's numbers, the user's files). Its side files are
    named after the output. If this fails, an eval silently overwrites files it did not write."""
    files, data = blend_inputs
    out_dir = tmp_path / "results"
    out_dir.mkdir()
    (out_dir / "metrics.json").write_text("the user's metrics")
    (out_dir / "reliability.png").write_bytes(b"the user's plot")
    assert eval_command(EvalRequest(None, ensemble=files, data=data, out=out_dir / "x.csv")) == 0
    assert eval_command(EvalRequest(None, ensemble=files, data=data, out=out_dir / "y.csv", plot=False)) == 0
    assert (out_dir / "metrics.json").read_text() == "the user's metrics"
    assert (out_dir / "reliability.png").read_bytes() == b"the user's plot"
    assert sorted(os.listdir(out_dir)) == [
        "metrics.json",
        "reliability.png",
        "x.csv",
        "x.metrics.json",
        "x.reliability.png",
        "y.csv",
        "y.metrics.json",
    ]


def test_eval_out_inside_a_run_s_checkpoints_is_refused(run, tmp_path, blend_inputs):
    """A predictions file inside `checkpoints/` (or a checkpoint folder, or over the run's own
    `predictions.csv`) would be pruned with the checkpoints or break them. Refused in one line
    before anything is computed. If this fails, eval writes into the run's own data."""
    files, data = blend_inputs
    before = snapshot(run)
    for out in (
        run / "checkpoints" / "p.csv",
        run / "checkpoints" / "step-000007" / "p.csv",
        run / "predictions.csv",
    ):
        with pytest.raises(UserError, match="write outputs outside it") as info:
            eval_command(EvalRequest(None, ensemble=files, data=data, out=out))
        assert "\n" not in str(info.value)
    assert snapshot(run) == before


def test_eval_outputs_are_written_durably(tmp_path, blend_inputs, monkeypatch):
    """Predictions, metrics JSON and reliability PNG go through one atomic, fsynced write. If this
    fails, a crash can leave a truncated predictions or metrics file under its real name."""
    files, data = blend_inputs
    spy = DurableWrites(monkeypatch)
    out = tmp_path / "results" / "x.csv"
    assert eval_command(EvalRequest(None, ensemble=files, data=data, out=out)) == 0
    for name in ("x.csv", "x.metrics.json", "x.reliability.png"):
        spy.assert_durable(out.with_name(name))
