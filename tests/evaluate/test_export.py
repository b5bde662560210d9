"""`hpref save`: consolidation round trip, refusal of partial/corrupt/tampered checkpoints.

(`--now` is tested with the run folder: tests/runfolder/test_save_trigger.py.)
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from hpref.arena import generate_battles
from hpref.errors import UserError
from hpref.evaluate.runner import formatter_for, load_model
from hpref.prediction.evaluation import evaluate_battles
from hpref.save import export

from .conftest import TINY_MODEL, make_run, write_recipe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import os

    os.environ["HPREF_CACHE"] = str(tmp_path_factory.getbasetemp() / "hpref-cache")
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    model, recipe, path = make_run(run_dir)
    (run_dir / "summary.json").write_text(
        json.dumps({"eval_log_loss": 0.9876, "eval_accuracy": 0.5, "eval_step": 7})
    )
    return run_dir, model, recipe, path


def _predict(model, recipe, battles):
    return evaluate_battles(
        model, battles, formatter=formatter_for(recipe, model.tokenizer), micro_batch_tokens=1024
    ).probs


def test_export_round_trip_gives_identical_predictions(run, tmp_path):
    run_dir, trained, recipe, checkpoint = run
    out = export.save_export(run_dir, tmp_path / "export", step="latest")
    for name in ("config.json", "model.safetensors", "head.safetensors", "hpref_model.json", "README.md"):
        assert (out / name).is_file(), name
    battles = list(generate_battles(12, seed=5))
    want = _predict(trained, recipe, battles)
    from_export = _predict(load_model(out), recipe, battles)
    from_checkpoint = _predict(load_model(checkpoint, recipe), recipe, battles)
    # the trained weights, not the seeded init, must come back: the init predicts differently
    np.testing.assert_allclose(from_export, want, atol=1e-6)
    np.testing.assert_allclose(from_checkpoint, want, atol=1e-6)
    card = (out / "README.md").read_text()
    assert "step 7" in card and "0.9876" in card and 'name = "tiny-llama"' in card
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(out)  # plain transformers reads the backbone
    assert torch.equal(backbone.state_dict()["norm.weight"], trained.backbone.state_dict()["norm.weight"])


def test_export_refuses_a_non_empty_target_and_writes_bf16(run, tmp_path):
    run_dir, _, _, _ = run
    target = tmp_path / "taken"
    target.mkdir()
    (target / "x").write_text("keep me")
    with pytest.raises(UserError, match="not empty"):
        export.save_export(run_dir, target)
    assert (target / "x").read_text() == "keep me"
    out = export.save_export(run_dir, tmp_path / "bf16", step=7, dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict) == {torch.bfloat16}
    with pytest.raises(export.CheckpointError, match="no checkpoint for step 8"):
        export.save_export(run_dir, tmp_path / "nope", step=8)


def _copy(checkpoint, tmp_path, name="step-000007"):
    import shutil

    run_dir = tmp_path / "run"
    dest = run_dir / "checkpoints" / name
    shutil.copytree(checkpoint, dest)
    write_recipe(run_dir)
    return dest


def test_truncated_shard_is_refused_before_loading(run, tmp_path):
    copy = _copy(run[3], tmp_path)
    shard = next(copy.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(export.CheckpointError, match="truncated"):
        export.save_export(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_shard_and_missing_train_state_are_partial(run, tmp_path):
    copy = _copy(run[3], tmp_path)
    (copy / "train_state.json").unlink()
    with pytest.raises(export.CheckpointError, match="did not finish"):
        export.load_model_from_checkpoint(copy)
    copy = _copy(run[3], tmp_path / "b")
    next(copy.glob("*.distcp")).unlink()
    with pytest.raises(export.CheckpointError, match="missing"):
        export.load_model_from_checkpoint(copy)


def test_corrupt_tensor_bytes_are_a_clear_error(run, tmp_path):
    copy = _copy(run[3], tmp_path)
    shard = next(copy.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = b"\0" * (len(data) // 2)  # same size, garbage content
    shard.write_bytes(bytes(data))
    with pytest.raises(export.CheckpointError, match="corrupt"):
        export.load_model_from_checkpoint(copy)


class _Evil:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_a_tampered_index_is_refused_without_running_its_code(run, tmp_path, monkeypatch):
    """An attacker who replaces `.metadata` also rewrites the checksums: the allow-list must still
    refuse the pickle before anything in it runs."""
    from hpref.runfolder.integrity import write_manifest

    monkeypatch.chdir(tmp_path)
    copy = _copy(run[3], tmp_path)
    (copy / ".metadata").write_bytes(pickle.dumps(_Evil()))
    write_manifest(copy)
    with pytest.raises(export.CheckpointError, match="names builtins.exec, which is not checkpoint metadata"):
        export.load_model_from_checkpoint(copy)
    assert not (tmp_path / "PWNED").exists()


def test_a_checkpoint_of_another_model_names_the_mismatch(run, tmp_path):
    copy = _copy(run[3], tmp_path)
    write_recipe(copy.parent.parent, model={**TINY_MODEL, "intermediate_size": 48})
    with pytest.raises(
        export.CheckpointError, match=r"has shape \[64, 32\] in the checkpoint and \[48, 32\]"
    ):
        export.load_model_from_checkpoint(copy)


@pytest.mark.parametrize(
    ("pooling", "says", "denies"),
    [
        ("last", ["AutoModelForSequenceClassification", "TRL", "OpenRLHF"], ["not OpenRLHF", "not TRL"]),
        ("first", ["AutoModelForSequenceClassification", "TRL", "not OpenRLHF"], ["not TRL"]),
        ("mean", ["sentence-transformers", "not TRL or OpenRLHF", "modules.json"], ["gives each answer's"]),
    ],
)
def test_a_reward_model_card_says_which_tools_load_it(pooling, says, denies):
    """The model card of a reward export names the tools that score it as hpref does, by pooling
    (README's table): a decoder's for TRL and OpenRLHF, BERT's CLS for TRL only, a mean-pooled one
    for sentence-transformers only. A card claiming TRL for a mean export would send users to a
    model with a random head."""
    from hpref.save.export import model_card

    card = model_card(
        recipe_toml="",
        checkpoint=Path("ckpt"),
        step=1,
        dtype="fp32",
        metrics={},
        reward=True,
        sequence_classifier=pooling != "mean",
        pooling=pooling,
    )
    for text in says:
        assert text in card, (pooling, text)
    for text in denies:
        assert text not in card, (pooling, text)
