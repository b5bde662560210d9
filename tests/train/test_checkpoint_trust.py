"""Checkpoints a user can trust (issue #11): a checkpoint never runs code, a damaged one is never
loaded silently, a diverged run never saves its damage.

Every hostile file here carries a payload that creates a marker file; each test asserts the marker
was not created and that the user saw one line naming the file. An attacker who edits a checkpoint
can also rewrite its `checksums.json`, so the hostile cases rewrite it: the allow-list alone must
refuse them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import run_hpref, run_hpref_here
from tests.evaluate.conftest import make_run
from tests.train.conftest import write_recipe

pytestmark = pytest.mark.slow


def _u(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def global_call_pickle(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that calls `module.name(arg)` on load. `name` may be dotted: pickle
    walks the dots from `module`, which is how an allow-list of *modules* is escaped
    (`torch.distributed.checkpoint.metadata` + `os.system`)."""
    return b"\x80\x04" + _u(module) + _u(name) + b"\x93" + _u(arg) + b"\x85R."


def payloads(marker: Path) -> dict[str, bytes]:
    touch = f"touch {marker}"
    return {
        "dotted name through DCP's metadata module": global_call_pickle(
            "torch.distributed.checkpoint.metadata", "os.system", touch
        ),
        "dotted name through torch": global_call_pickle("torch", "serialization.os.system", touch),
        "posix.system": global_call_pickle("posix", "system", touch),
        "builtins.exec": global_call_pickle("builtins", "exec", f"open({str(marker)!r}, 'w')"),
    }


class _Evil:
    """Pickles as a call of os.system: what a tampered non-tensor item would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hpref(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Each use here is refused before anything is launched or loaded: through the CLI's own entry
    point in this process (`run_hpref_here`), not a new interpreter's seconds of imports."""
    return run_hpref_here(*args, cwd=cwd)


def _one_error_line(result: subprocess.CompletedProcess, must_name: str) -> str:
    """The run failed with exit 2 and said so in one `error:` line naming `must_name`."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error:") or " ERROR " in f" {line} "]
    assert len(errors) == 1, result.stderr[-3000:]
    assert must_name in errors[0], errors[0]
    return errors[0]


# --------------------------------------------------------------------------------------------------
# the reader itself


def test_every_hostile_index_is_refused_before_its_code_runs(tmp_path):
    """The index reader admits exact (module, name) pairs only. If this fails, a downloaded
    checkpoint can run a shell command on `hpref eval`, `save` or resume."""
    from hpref.runfolder.safe_load import UnsafeCheckpointError, read_dcp_index

    marker = tmp_path / "MARKER"
    for what, data in payloads(marker).items():
        folder = tmp_path / what.replace(" ", "-").replace("'", "")
        folder.mkdir()
        (folder / ".metadata").write_bytes(data)
        with pytest.raises(UnsafeCheckpointError, match="not checkpoint metadata"):
            read_dcp_index(folder)
        assert not marker.exists(), f"{what}: the payload ran"


def test_non_tensor_items_never_reach_an_unrestricted_torch_load(tmp_path):
    """DCP's default planner reads non-tensor items (optimizer param_groups) with
    `torch.load(weights_only=False)`. If this fails, a tampered `.distcp` shard runs code on resume
    even when the index is clean."""
    import torch.distributed.checkpoint as dcp

    from hpref.runfolder.safe_load import CheckpointError, dcp_load

    marker = tmp_path / "MARKER"
    dcp.save({"w": torch.ones(2), "lr": _Evil(marker)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"\[lr\].*refused"):
        dcp_load({"w": torch.zeros(2), "lr": 0.0}, tmp_path / "ckpt", no_dist=True)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------------
# hpref eval and hpref save on hostile and damaged checkpoints


@pytest.fixture
def exported_run(tmp_path):
    run_dir = tmp_path / "runs" / "tiny"
    _model, _recipe, checkpoint = make_run(run_dir)
    return run_dir, checkpoint


def _eval_and_save(run_dir: Path, tmp_path: Path) -> list[subprocess.CompletedProcess]:
    from hpref.arena import generate_battles
    from hpref.data.readers import write_arena_file

    data = write_arena_file(tmp_path / "eval.csv", list(generate_battles(6, seed=5)))
    return [
        _hpref("eval", str(run_dir / "recipe.toml"), "--checkpoint", str(run_dir), "--data", str(data),
               "--out", str(tmp_path / "preds" / "p.csv"), "--no-plot", cwd=tmp_path),
        _hpref("save", str(run_dir), "--to", str(tmp_path / "export"), cwd=tmp_path),
    ]  # fmt: skip


def test_eval_and_save_refuse_a_hostile_index_and_nothing_runs(exported_run, tmp_path):
    """`hpref eval --checkpoint` and `hpref save` on a checkpoint whose `.metadata` calls os.system
    through a dotted name (with its checksums rewritten to match). If this fails, loading a
    stranger's checkpoint runs their code."""
    from hpref.runfolder.integrity import write_manifest

    run_dir, checkpoint = exported_run
    marker = tmp_path / "MARKER"
    (checkpoint / ".metadata").write_bytes(payloads(marker)["dotted name through DCP's metadata module"])
    write_manifest(checkpoint)
    for result in _eval_and_save(run_dir, tmp_path):
        _one_error_line(result, ".metadata")
        assert not marker.exists()
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("damage", ["random bytes in a shard", "truncated shard", "random .metadata"])
def test_eval_and_save_refuse_a_damaged_checkpoint_in_one_line(exported_run, tmp_path, damage):
    """4 KB of random bytes in a shard used to load silently (NaN weights exported); a truncated
    shard or random `.metadata` gave raw tracebacks. Each must be one line naming the file."""
    run_dir, checkpoint = exported_run
    shard = next(checkpoint.glob("*.distcp"))
    if damage == "random bytes in a shard":
        data = bytearray(shard.read_bytes())
        data[100 : 100 + 4096] = os.urandom(min(4096, len(data) - 100))
        shard.write_bytes(bytes(data))
        named = shard.name
    elif damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        named = shard.name
    else:
        (checkpoint / ".metadata").write_bytes(os.urandom(2048))
        named = ".metadata"
    for result in _eval_and_save(run_dir, tmp_path):
        line = _one_error_line(result, named)
        assert "does not verify" in line
    assert not (tmp_path / "export").exists()


# --------------------------------------------------------------------------------------------------
# train resume


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A 1-rank run of 6 steps with checkpoints at steps 3 and 6."""
    from hpref.train import run_train

    folder = tmp_path_factory.mktemp("short")
    os.environ.setdefault("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    recipe = write_recipe(folder, "short")
    code = run_train(recipe, ["train.max_steps=6", "train.eval_interval=0"], nproc_per_node=1)
    assert code == 0
    run_dir = folder / "runs" / "short"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000003", "step-000006"]
    return recipe, run_dir


def _copy_run(short_run, tmp_path: Path) -> tuple[Path, Path]:
    recipe, run_dir = short_run
    target = tmp_path / "runs" / "short"
    shutil.copytree(run_dir, target)
    text = recipe.read_text().replace(str(run_dir.parent), str(target.parent))
    new_recipe = tmp_path / "short.toml"
    new_recipe.write_text(text)
    return new_recipe, target


def _resume(recipe: Path, tmp_path: Path, *extra: str, refused: bool = True) -> subprocess.CompletedProcess:
    """`hpref train --resume auto` to step 7; one that is expected to train (`refused=False`) runs in
    its own process, as a user's does."""
    args = ["train", str(recipe), "--nproc-per-node", "1", "--resume", "auto", "--set", "train.max_steps=7"]
    args += ["--set", "train.eval_interval=0", *extra]
    return _hpref(*args, cwd=tmp_path) if refused else run_hpref(*args, cwd=tmp_path, timeout=300)


def test_resume_refuses_a_hostile_optimizer_item_and_nothing_runs(short_run, tmp_path):
    """The latest checkpoint re-saved with an optimizer `lr` that pickles as os.system, checksums
    rewritten. If this fails, `hpref train --resume auto` on a tampered run folder runs code on
    every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from hpref.runfolder.integrity import write_manifest

    recipe, run_dir = _copy_run(short_run, tmp_path)
    checkpoint = run_dir / "checkpoints" / "step-000006"
    dcp_to_torch_save(str(checkpoint), str(tmp_path / "full.pt"))  # our own, trusted, file
    state = torch.load(tmp_path / "full.pt", weights_only=False)
    marker = tmp_path / "MARKER"
    state["optim"]["param_groups"][0]["lr"] = _Evil(marker)
    for shard in checkpoint.glob("*.distcp"):
        shard.unlink()
    dcp.save(state, checkpoint_id=str(checkpoint), no_dist=True)
    write_manifest(checkpoint)
    assert not marker.exists()
    _one_error_line(_resume(recipe, tmp_path), "lr")
    assert not marker.exists()


def test_resume_auto_falls_back_to_the_newest_checkpoint_that_verifies(short_run, tmp_path):
    """Random bytes in the latest checkpoint's shard: resume must say so and continue from the
    older checkpoint, never train on from the damaged one (which went on with NaN losses)."""
    recipe, run_dir = _copy_run(short_run, tmp_path)
    shard = next((run_dir / "checkpoints" / "step-000006").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[200:4296] = os.urandom(4096)
    shard.write_bytes(bytes(data))
    result = _resume(recipe, tmp_path, refused=False)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "skipping" in log and "step-000006" in log and "SHA-256" in log
    assert "resuming from step-000003, the newest checkpoint that verifies" in log
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in metrics if r["kind"] == "train"]
    assert train_steps == list(range(1, 8)), train_steps  # steps 4-7 retrained from step 3
    assert all(r["loss"] == r["loss"] for r in metrics if r["kind"] == "train")  # no NaN


@pytest.mark.parametrize("damage", ["train_state.json", "checksums.json", "every checkpoint"])
def test_resume_refuses_damaged_state_in_one_line(short_run, tmp_path, damage):
    """A broken `train_state.json` gave a JSONDecodeError without the file name; a run whose every
    checkpoint is damaged must not quietly start over."""
    from hpref.runfolder.integrity import write_manifest

    recipe, run_dir = _copy_run(short_run, tmp_path)
    latest = run_dir / "checkpoints" / "step-000006"
    if damage == "train_state.json":
        (latest / "train_state.json").write_text('{"step": 6, "sampler": ')
        write_manifest(latest)  # consistent checksums: the JSON itself must be checked
        for older in (run_dir / "checkpoints").glob("step-000003"):
            shutil.rmtree(older)
        named = "train_state.json"
    elif damage == "checksums.json":
        (latest / "checksums.json").write_text("{not json")
        shutil.rmtree(run_dir / "checkpoints" / "step-000003")
        named = "no checkpoint"
    else:
        for folder in (run_dir / "checkpoints").glob("step-*"):
            (folder / ".metadata").write_bytes(b"\0" * 64)
        named = "no checkpoint"
    _one_error_line(_resume(recipe, tmp_path), named)


# --------------------------------------------------------------------------------------------------
# a diverged run


def test_a_nan_loss_stops_the_run_names_the_step_and_saves_nothing(tmp_path):
    """lr 1e30 blows the weights up at the first update, so step 2's loss is not finite. If this
    fails, the run trains on with NaN losses to the end (exit 0) and checkpoints the damage."""
    from hpref.train import run_train

    recipe = write_recipe(tmp_path, "nan")
    code = run_train(recipe, ["optimizer.lr=1e30", "train.max_steps=6"], nproc_per_node=1)
    run_dir = tmp_path / "runs" / "nan"
    assert code == 3
    assert not list((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").exists() else True
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "(not finite); stopped without saving; there is no checkpoint before it" in log
    assert "step 2: training loss" in log or "step 1: training loss" in log


def test_the_divergence_message_names_the_last_good_checkpoint(short_run):
    """With checkpoints on disk the line must say which one to resume from."""
    from hpref.train.loop import _diverged

    _recipe, run_dir = short_run
    exc = _diverged(run_dir, 9, torch.tensor(float("nan")), torch.tensor(float("inf")))
    assert exc.exit_code == 3
    assert str(exc).startswith("step 9: training loss nan, gradient norm inf (not finite)")
    assert str(run_dir / "checkpoints" / "step-000006") in str(exc)


# --------------------------------------------------------------------------------------------------
# durability of a save


def test_a_checkpoint_is_fsynced_before_it_is_renamed_and_before_latest_names_it(tmp_path, monkeypatch):
    """Every file of the checkpoint (shards, index, states, manifest) is fsynced while it still has
    its temporary name, the rename into `step-N` is made durable, and only then does `latest` move.
    If this fails, a power cut after `latest` moved can leave it naming a folder of empty files."""
    from tests.durable import DurableWrites

    writes = DurableWrites(monkeypatch)
    events: list[str] = []
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        events.append(f"replace {Path(dst).name}")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    run_dir = tmp_path / "runs" / "tiny"
    _model, _recipe, final = make_run(run_dir)
    tmp = final.parent / f".tmp-{final.name}"
    files = sorted(p.name for p in final.iterdir())
    assert "checksums.json" in files and ".metadata" in files and "train_state.json" in files
    for name in files:
        assert (tmp / name).resolve() in writes.fsynced or any(
            f.name.startswith(f".{name}.") and f.parent == tmp.resolve() for f in writes.fsynced
        ), f"{name} was not fsynced before the checkpoint was renamed into place"
    assert final.parent.resolve() in writes.fsynced  # the rename itself is durable
    assert events.index(f"replace {final.name}") < events.index("replace latest")
    writes.assert_durable(final.parent / "latest")
