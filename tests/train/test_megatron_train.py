"""The megatron-gpt backend through the real trainer (issue #15): `hpref train` on 2 gloo ranks with
tensor parallel 2 and 1, kill and resume, `hpref save` to a transformers folder and `hpref eval` of it.

The model is the tiny Llama of tests/train/conftest.py built by `megatron-gpt` from the same config,
tokenizer and seed as `tiny-llama`, so the FSDP2 path's run is a reference for every number.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.train.conftest import RECIPE, TOTAL_STEPS, train_losses

pytest.importorskip("megatron.core", reason="megatron-core is the optional [megatron] extra")
pytestmark = pytest.mark.slow

#: the FSDP test recipe's [model] section (tests/train/conftest.py), replaced by MEGATRON_MODEL below
TINY_MODEL = "[model]" + RECIPE.split("[model]", 1)[1].split("\n\n[", 1)[0] + "\n"

#: the same tiny Llama as a megatron-gpt model: TINY_MODEL's shape lines under [model.tiny_llama]
_SHAPE = TINY_MODEL.split('name = "tiny-llama"\n')[1].split("head_dropout")[0]
MEGATRON_MODEL = (
    '[model]\nname = "megatron-gpt"\ntensor_parallel = {tp}\nhead_dropout = 0.0\n\n[model.tiny_llama]\n'
    + _SHAPE
)


def write_megatron_recipe(folder: Path, name: str, tp: int, sequence_parallel: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    model = MEGATRON_MODEL.format(tp=tp)
    if sequence_parallel:
        model = model.replace(
            f"tensor_parallel = {tp}\n", f"tensor_parallel = {tp}\nsequence_parallel = true\n"
        )
    text = RECIPE.replace(TINY_MODEL, model)
    path.write_text(text.format(name=name, output_dir=(folder / "runs").as_posix()))
    return path


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """An uninterrupted TP = 2 run on 2 ranks with megatron's sequence parallelism (rows padded to an
    even length, activations split by tokens between the tensor-parallel regions), every step: the
    reference of the resume and save tests. TP = 2 without sequence parallelism is test_megatron.py's
    (the backbone over two gloo ranks, step by step): a run of each here cost the suite ~25 s."""
    import os

    from hpref.train import run_train

    folder = tmp_path_factory.mktemp("megatron-tp2")
    os.environ.setdefault("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    assert (
        run_train(write_megatron_recipe(folder, "ref", tp=2, sequence_parallel=True), nproc_per_node=2) == 0
    )
    return folder


def test_tensor_parallel_2_and_1_follow_the_fsdp_loss_curve(tmp_path, tp2_run, two_rank_run):
    """TP = 2 with sequence parallelism (one model over both ranks), TP = 1 x DP = 2 and the FSDP2
    tiny-llama run of the same model give the same losses step by step. If this fails, megatron's
    split of the model over the ranks, the data-parallel split of the batches (tensor-parallel ranks
    must see the same micro-batches), the gradient averaging or the loss reduction differs from the
    FSDP path; or, under sequence parallelism, the padding leaks into a real sequence, the gathered
    output feeds the head the wrong tokens, or the norms' partial gradients are not summed over the
    tensor-parallel ranks (or the recipe's `sequence_parallel` never reached the model)."""
    from hpref.train import run_train

    recipe = write_megatron_recipe(tmp_path, "tp1", tp=1)
    assert run_train(recipe, nproc_per_node=2) == 0  # all steps: the LR schedule follows their number
    tp1 = train_losses(tmp_path / "runs" / "tp1")
    tp2 = train_losses(tp2_run / "runs" / "ref")
    fsdp = train_losses(two_rank_run)
    assert sorted(tp1) == sorted(tp2) == list(range(1, TOTAL_STEPS + 1))
    for step in tp1:
        assert tp2[step] == pytest.approx(tp1[step], abs=2e-5), f"step {step}"
        assert tp1[step] == pytest.approx(fsdp[step], abs=2e-5), f"step {step}"
    assert "sequence parallel" in (tp2_run / "runs" / "ref" / "logs" / "rank0.log").read_text()
    assert "sequence parallel" not in (tmp_path / "runs" / "tp1" / "logs" / "rank0.log").read_text()


def test_tensor_parallel_run_killed_mid_epoch_resumes_to_the_same_losses(tmp_path, tp2_run, monkeypatch):
    """TP = 2 run stopped after step 7 (latest checkpoint: step 6, mid-epoch), resumed with `--resume
    auto`: every later step has the uninterrupted run's loss. If this fails, a tensor-parallel shard
    of the weights or of AdamW's moments is not saved or restored as that rank's shard (DCP would
    keep one rank's copy of a same-named plain tensor), or the sampler / scheduler / RNG state is lost."""
    from hpref.train import run_train

    recipe = write_megatron_recipe(tmp_path, "ref", tp=2, sequence_parallel=True)  # the reference's
    run_dir = tmp_path / "runs" / "ref"
    monkeypatch.setenv("HPREF_DEBUG_CRASH_AFTER_STEP", "7")
    assert run_train(recipe, nproc_per_node=2) != 0
    monkeypatch.delenv("HPREF_DEBUG_CRASH_AFTER_STEP")
    assert (run_dir / "checkpoints" / "step-000006").is_dir()
    assert run_train(recipe, nproc_per_node=2, resume="auto") == 0
    resumed, reference = train_losses(run_dir), train_losses(tp2_run / "runs" / "ref")
    assert sorted(reference) == list(range(1, TOTAL_STEPS + 1))
    for step in range(7, TOTAL_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), f"step {step}"
    assert "resumed from" in (run_dir / "logs" / "rank1.log").read_text()


@pytest.fixture
def release_process_group():
    """`hpref save` of a megatron run builds the model in this process, on a one-process group that
    stays for the model's life (hpref.models.megatron.preference.init_model_parallel): end it."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_save_of_a_tensor_parallel_run_is_a_transformers_folder_with_the_same_predictions(
    tmp_path, tp2_run, release_process_group
):
    """`hpref save` of the TP = 2 run (one process: the shards are read back as full tensors) writes
    a plain transformers Llama folder, and `hpref eval` of it reproduces the run's own last eval
    predictions (1e-5). If this fails, the export's conversion back from megatron's layout (fused
    QKV per query group, fused gate/up, padded vocabulary) or the checkpoint's layout is wrong."""
    assert_export_reproduces_predictions(tp2_run / "runs" / "ref", tp2_run / "ref.toml", tmp_path)


def assert_export_reproduces_predictions(run_dir: Path, recipe: Path, tmp_path: Path) -> None:
    """`hpref save` of a megatron-gpt run is a plain transformers Llama folder (strict keys, the tiny
    model's 2 layers, megatron-gpt provenance) whose `hpref eval` gives the run's own last eval
    predictions to 1e-5."""
    from transformers import AutoConfig, AutoModel

    from hpref.evaluate.command import EvalRequest, eval_command
    from hpref.prediction.files import read_predictions
    from hpref.save.command import SaveRequest, save_command

    export = tmp_path / "export"
    assert save_command(SaveRequest(run_dir, to=export)) == 0
    assert AutoConfig.from_pretrained(export).model_type == "llama"
    backbone = AutoModel.from_pretrained(export)  # strict keys: a plain transformers checkpoint
    assert backbone.config.num_hidden_layers == 2
    assert json.loads((export / "hpref_model.json").read_text())["provenance"]["component"] == "megatron-gpt"

    out = tmp_path / "export-predictions.csv"
    assert eval_command(EvalRequest(recipe, checkpoint=export, out=out, plot=False)) == 0
    ours, theirs = read_predictions(out), read_predictions(run_dir / "predictions.csv")
    assert ours.ids == theirs.ids
    assert abs(ours.probs - theirs.probs).max() < 1e-5
