"""megatron-gpt with pipeline_parallel = 2 through the real trainer (issue #15): `hpref train` on 2
gloo ranks, one decoder layer per rank (hpref's GPipe schedule, `hpref.models.megatron.pipeline`),
kill and resume, `hpref save` to a transformers folder and `hpref eval` of it.

The model is test_megatron_train.py's: the tiny Llama of tests/train/conftest.py built by
`megatron-gpt`, so the FSDP2 path's uninterrupted run is the reference for every number. To keep
the suite short there is one PP = 2 run, killed after step 7 and resumed; every test reads it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.train.conftest import TOTAL_STEPS, train_losses
from tests.train.test_megatron_train import (  # noqa: F401 (release_process_group: a fixture)
    assert_export_reproduces_predictions,
    release_process_group,
    write_megatron_recipe,
)

pytest.importorskip("megatron.core", reason="megatron-core is the optional [megatron] extra")
pytestmark = pytest.mark.slow


def write_pipeline_recipe(folder: Path, name: str) -> Path:
    """test_megatron_train.py's TP = 1 recipe with two pipeline stages."""
    path = write_megatron_recipe(folder, name, tp=1)
    text = path.read_text()
    assert "tensor_parallel = 1\n" in text
    path.write_text(text.replace("tensor_parallel = 1\n", "tensor_parallel = 1\npipeline_parallel = 2\n"))
    return path


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    """A PP = 2 run on 2 ranks, stopped after step 7 (latest checkpoint: step 6, mid-epoch) and
    resumed with `--resume auto` to the end; returns its folder (the recipe `ref.toml`, the run
    `runs/ref`) and whether the interrupted part stopped and left its checkpoint."""
    import os

    from hpref.train import run_train

    folder = tmp_path_factory.mktemp("megatron-pp2")
    os.environ.setdefault("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    recipe = write_pipeline_recipe(folder, "ref")
    os.environ["HPREF_DEBUG_CRASH_AFTER_STEP"] = "7"
    try:
        stopped = run_train(recipe, nproc_per_node=2) != 0
    finally:
        del os.environ["HPREF_DEBUG_CRASH_AFTER_STEP"]
    checkpointed = (folder / "runs" / "ref" / "checkpoints" / "step-000006").is_dir()
    assert run_train(recipe, nproc_per_node=2, resume="auto") == 0
    return folder, stopped and checkpointed


def test_pipeline_parallel_2_follows_the_fsdp_loss_curve(pp2_run, two_rank_run):
    """PP = 2 (layer 0 and the embedding on rank 0, layer 1, norm, head and loss on rank 1, both
    ranks on the same micro-batches) gives the uninterrupted FSDP2 tiny-llama run's loss and
    gradient norm step by step, before the stop (steps 1-7) and after the resume. If this fails
    before step 7, the stages are not megatron's split of the same model (a layer built twice or
    with the wrong weights), an activation or its gradient is lost between the stages, the loss is
    not the last stage's, or the gradient norm is not summed over both stages; from step 7 on, see
    the resume test."""
    from hpref.train.metrics import read_metrics

    folder, _ = pp2_run
    pp2 = train_losses(folder / "runs" / "ref")
    fsdp = train_losses(two_rank_run)
    assert sorted(pp2) == list(range(1, TOTAL_STEPS + 1))
    for step in pp2:
        assert pp2[step] == pytest.approx(fsdp[step], abs=2e-5), f"step {step}"

    def grad_norms(run_dir: Path) -> dict[int, float]:
        records = read_metrics(run_dir / "metrics.jsonl")
        return {r["step"]: r["grad_norm"] for r in records if r["kind"] == "train"}

    ours, theirs = grad_norms(folder / "runs" / "ref"), grad_norms(two_rank_run)
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-4), f"step {step}"
    log = (folder / "runs" / "ref" / "logs" / "rank1.log").read_text()
    assert "pipeline stage 2 of 2" in log


def test_pipeline_parallel_run_killed_mid_epoch_resumes_to_the_uninterrupted_losses(pp2_run, two_rank_run):
    """The PP = 2 run stopped after step 7 (latest checkpoint: step 6, mid-epoch) and resumed with
    `--resume auto` by both stages: every step from 7 on has the uninterrupted run's loss (the FSDP2
    run's, which an uninterrupted PP = 2 run matches to ~1e-7). If this fails, a stage's layers or
    AdamW moments are stored under its local layer numbers (both stages' layer 0 under one key, DCP
    keeps one), or are not restored into the stage that owns them, or a stage's LR scheduler is
    restored from another stage's parameter groups."""
    folder, stopped_with_a_checkpoint = pp2_run
    run_dir = folder / "runs" / "ref"
    assert stopped_with_a_checkpoint, "the run did not stop after step 7 with its step-6 checkpoint"
    resumed, reference = train_losses(run_dir), train_losses(two_rank_run)
    assert sorted(resumed) == list(range(1, TOTAL_STEPS + 1))
    for step in range(7, TOTAL_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], abs=2e-5), f"step {step}"
    for rank in (0, 1):
        assert "resumed from" in (run_dir / "logs" / f"rank{rank}.log").read_text()


def test_save_of_a_pipeline_parallel_run_is_a_transformers_folder_with_the_same_predictions(
    tmp_path,
    pp2_run,
    release_process_group,  # noqa: F811
):
    """`hpref save` of the PP = 2 run (one process builds the model unsplit and reads both stages'
    layers by their global keys) writes a plain transformers Llama folder, and `hpref eval` of it
    reproduces the run's own last eval predictions (1e-5), which the two stages computed together.
    If this fails, a stage's layer is stored under another layer's key, the export misses the last
    stage's norm or head, or the pipeline's eval returned other logits than the model's."""
    folder, _ = pp2_run
    assert_export_reproduces_predictions(folder / "runs" / "ref", folder / "ref.toml", tmp_path)


def test_a_pipeline_reward_model_evaluates_as_the_unsplit_model(
    tmp_path,
    release_process_group,  # noqa: F811
):
    """The shipped megatron-quickstart (a reward model: one logit row per pair of sequences) with two
    pipeline stages, a few steps: its eval, which the stages compute together, equals `hpref eval`
    of its checkpoint on one process (the model unsplit) to 1e-5. If this fails, a stage other than
    the last allocates the logits with the judge's shape (one row per sequence) and the run dies at
    its first eval, or the stages' eval differs from the model's."""
    from hpref.evaluate.command import EvalRequest, eval_command
    from hpref.prediction.files import read_predictions
    from hpref.recipe.catalog import resolve_recipe_path
    from hpref.train import run_train

    overrides = [
        f'run.output_dir="{(tmp_path / "runs").as_posix()}"',
        "model.pipeline_parallel=2",
        "model.tiny_llama.num_hidden_layers=2",
        "dataset.train.num_battles=200",
        "dataset.eval.num_battles=100",
        "train.batch_size=16",
        "train.max_steps=3",
        "train.micro_batch_tokens=2048",
    ]
    recipe = resolve_recipe_path("megatron-quickstart")
    assert run_train(recipe, overrides, nproc_per_node=2) == 0
    run_dir = tmp_path / "runs" / "megatron-quickstart"
    out = tmp_path / "one-process.csv"
    assert eval_command(EvalRequest(run_dir / "recipe.toml", checkpoint=run_dir, out=out, plot=False)) == 0
    ours, theirs = read_predictions(out), read_predictions(run_dir / "predictions.csv")
    assert ours.ids == theirs.ids and len(ours.ids) >= 10, len(ours.ids)  # fold 0 of 5 of 100
    assert abs(ours.probs - theirs.probs).max() < 1e-5
