"""End-to-end engine tests: real process groups (gloo), torchrun for 2 ranks, tiny sizes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.train.conftest import LOGGERS, TOTAL_STEPS, train_losses, write_recipe
from tests.train.logger_files import (
    assert_curves_match,
    tensorboard_scalars,
    train_curves,
    wandb_curves,
    wandb_run,
)

pytestmark = pytest.mark.slow

#: The first loss of a fresh head: the entropy of the train fold's label prior (see the first test).
FIRST_LOSS = 0.96


def test_one_rank_and_two_ranks_follow_the_same_loss_curve(tmp_path, two_rank_run):
    """Same global batch on 1 and 2 ranks -> same losses. If this fails, the loss weighting over
    micro-batches and ranks is wrong (FSDP's gradient averaging not undone, fillers counted, or the
    per-step denominator not global), or the ranks do not see the same data."""
    from hpref.train import run_train

    recipe = write_recipe(tmp_path, "one")
    assert run_train(recipe, nproc_per_node=1) == 0
    one, two = train_losses(tmp_path / "runs" / "one"), train_losses(two_rank_run)
    assert sorted(one) == sorted(two) == list(range(1, TOTAL_STEPS + 1))
    for step in one:
        assert one[step] == pytest.approx(two[step], abs=2e-5), f"step {step}"
    # a fresh head starts at the train labels' prior (its output bias = their log prior, #12): the
    # first loss is that prior's entropy, 0.96 on this fold, below uniform's ln 3 = 1.0986
    assert one[1] == pytest.approx(FIRST_LOSS, abs=0.03)
    from hpref.train.metrics import read_metrics

    evals = [r for r in read_metrics(two_rank_run / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals, "the 2-rank run never evaluated"
    assert (
        (two_rank_run / "predictions.csv")
        .read_text()
        .startswith("id,winner_model_a,winner_model_b,winner_tie")
    )


#: the seed of the fault plan of the chaos test below (benchmarks/chaos_train.py's --seed)
CHAOS_SEED = 47


def test_run_killed_twice_resumes_to_the_reference_bit_for_bit(tmp_path, two_rank_run):
    """benchmarks/chaos_train.py's short version: `hpref train` of the reference's recipe (same name:
    same seeds, same data) SIGKILLed twice at seeded random steps, a rank (torchrun worker) and then
    the launcher, each time resumed with `--resume auto` (a partial save planted beside the complete
    ones before the second resume). Every step's loss, the final checkpoint's bytes (weights, AdamW
    moments, RNG states) and each checkpoint the reference kept too must be the uninterrupted run's.
    If this fails, some state is not saved or not restored (optimizer moments, scheduler, sampler
    position, RNG), resume picked the partial or an older checkpoint, a step was logged twice, the
    killed launcher's workers outlived it (PR_SET_PDEATHSIG), or TensorBoard (W&B: but for what the
    killed launches alone logged) lost or repeated steps across the resumes."""
    import argparse

    from benchmarks.chaos_train import failures, run_chaos, verify

    write_recipe(tmp_path / "chaos", "ref")
    run_dir = tmp_path / "chaos" / "runs" / "ref"
    ctx = {
        "total": TOTAL_STEPS,
        "saves": [],  # only an ENOSPC fault (not planned here) writes into a chosen save
        "run_dir": run_dir,
        "ref_dir": two_rank_run,
        "record": tmp_path / "inject" / "fired.json",
        "cache": Path(os.environ["HPREF_CACHE"]),  # the session's tokenizer, trained once
        "recipe": "ref.toml",
        "sets": [],
        "extra": [a for name in LOGGERS for a in ("--log", name)],
    }

    def plant_partial(fault: int) -> None:
        if fault == 1:  # a save that died half-way, newer than every complete one
            partial = run_dir / "checkpoints" / f".tmp-step-{TOTAL_STEPS - 1:06d}"
            partial.mkdir()
            (partial / "__0_0.distcp").write_bytes(b"garbage")

    ctx["before_resume"] = plant_partial
    plan = argparse.Namespace(kills=2, seed=CHAOS_SEED, enospc_file="shard")
    chaos = run_chaos(plan, tmp_path, ctx)
    checks = verify(tmp_path, two_rank_run, run_dir, chaos, plan.kills, exports=False)
    assert not failures(checks), "\n".join(failures(checks))
    assert [f["kind"] for f in chaos["faults"]] == ["rank", "launcher"]
    resumed, reference = train_losses(run_dir), train_losses(two_rank_run)
    assert resumed == reference and sorted(resumed) == list(range(1, TOTAL_STEPS + 1))
    # TensorBoard continues the same curves: each step once, metrics.jsonl's resumed values
    expected = train_curves(run_dir)
    assert_curves_match(expected, tensorboard_scalars(run_dir / "tensorboard"))

    # W&B too, but it may lack every row a killed launch logged: its writer (wandb-core) died with
    # it, its offline file holds what it had flushed (often its header alone), and the resume does
    # not log them again (wandb_steps.json, written as it logs, says they were). Steps logged by two
    # launches (after the save a resume started from) show the first copy (timings differ)
    def resumed_at(fault: dict) -> int:
        return int((fault["after_fault"]["resume_would_pick"] or "step-0").removeprefix("step-"))

    redone = {s for f in chaos["faults"] for s in range(resumed_at(f) + 1, f["logged_to"] + 1)}
    lost = set(range(1, max(f["logged_to"] for f in chaos["faults"]) + 1))
    history, _config = wandb_run(run_dir, killed_starts=True)
    shown = {**wandb_curves(history, "train/step"), **wandb_curves(history, "eval/step")}
    for name, points in expected.items():
        got = shown.get(name, {})
        assert set(points) - lost <= set(got) <= set(points), f"W&B {name}: steps {sorted(got)}, lost {lost}"
        for step in set(got) - redone:
            assert got[step] == pytest.approx(points[step], rel=1e-6), f"W&B {name} at step {step}"
    log = (run_dir / "logs" / "rank0.log").read_text()  # the workers log to files, not to pytest
    assert "ignoring partial checkpoint" in log and f".tmp-step-{TOTAL_STEPS - 1:06d}" in log
    last = chaos["faults"][-1]["resumed_from"]
    assert last and "resumed from" in log and last in log
    assert last in (run_dir / "logs" / "rank1.log").read_text()


def test_a_failing_rank_ends_the_run_fast_and_is_named(tmp_path, monkeypatch, log_messages):
    """Rank 1 raises at its first step while rank 0 waits in a collective. If this hangs or returns 0,
    the launcher does not propagate child failures; if the message lacks the rank, users cannot
    find the log that explains it."""
    from hpref.train import run_train

    recipe = write_recipe(tmp_path, "fail")
    monkeypatch.setenv("HPREF_DEBUG_FAIL_RANK", "1")
    start = time.monotonic()
    code = run_train(recipe, nproc_per_node=2)
    assert code == 1
    assert time.monotonic() - start < 60
    text = "\n".join(log_messages)
    assert "rank 1 failed (exit code 1)" in text, text[-2000:]
    assert "SimulatedCrash" in text and "rank1.log" in text


def test_init_then_train_starts_from_the_saved_weights(tmp_path):
    """`hpref init` writes safetensors; `train` in the same run folder must load them. The test
    biases the saved head towards 'A wins': if the first loss is still ~ln 3, train ignored them."""
    import torch
    from safetensors.torch import load_file, save_file

    from hpref.train import run_init, run_train

    recipe = write_recipe(tmp_path, "init")
    folder = run_init(recipe, ["train.max_steps=2", "train.eval_interval=0"])
    assert folder == tmp_path / "runs" / "init" / "init"
    head = load_file(str(folder / "head.safetensors"))
    assert {"head.out_proj.bias", "head.dense.weight"} <= set(head)
    head["head.out_proj.bias"] = torch.tensor([6.0, 0.0, 0.0])
    save_file(head, str(folder / "head.safetensors"))

    assert run_train(recipe, ["train.max_steps=2", "train.eval_interval=0"]) == 0
    losses = train_losses(tmp_path / "runs" / "init")
    assert losses[1] > 2.5, losses


def test_bf16_with_activation_checkpointing_trains(tmp_path):
    """The mixed-precision path (bf16 compute, fp32 master weights and reductions) with per-block
    activation checkpointing runs and gives a finite first loss at the label prior's entropy."""
    import math

    from hpref.train import run_train

    recipe = write_recipe(tmp_path, "bf16")
    overrides = ['train.precision="bf16"', "train.activation_checkpointing=true", "train.max_steps=3"]
    assert run_train(recipe, overrides) == 0
    losses = train_losses(tmp_path / "runs" / "bf16")
    assert all(math.isfinite(v) for v in losses.values())
    assert losses[1] == pytest.approx(FIRST_LOSS, abs=0.03)
    log = (tmp_path / "runs" / "bf16" / "logs" / "rank0.log").read_text()
    assert "compute bf16" in log and "activation checkpointing on" in log


def test_dry_run_prints_the_command_and_the_recipe(tmp_path, capsys):
    """`--dry-run` starts nothing and shows the exact torchrun command and the resolved recipe."""
    from hpref.train import run_train

    recipe = write_recipe(tmp_path, "dry")
    assert run_train(recipe, ["train.epochs=3"], nproc_per_node=2, resume="auto", dry_run=True) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("torchrun --nproc-per-node 2 --nnodes 1 --max-restarts 0 --rdzv-backend c10d")
    assert "--rdzv-endpoint 127.0.0.1:" in first
    assert f"--module hpref.train.worker --recipe {recipe} --set train.epochs=3 --resume auto" in first
    assert "epochs = 3" in out and "[model]" in out
    assert not (tmp_path / "runs").exists()

    assert run_train(recipe, nproc_per_node=1, dry_run=True) == 0
    assert "-m hpref.train.worker --recipe" in capsys.readouterr().out


def test_multi_node_command_uses_the_given_rendezvous(tmp_path):
    """Several nodes: torchrun's static rendezvous with the node rank as given (the CLI's, else the
    recipe's). If this fails, nodes would not find each other or would swap ranks."""
    from hpref.errors import UserError
    from hpref.recipe import load_recipe
    from hpref.train.launch import plan_launch

    recipe_path = write_recipe(tmp_path, "nodes")
    recipe = load_recipe(recipe_path)
    static = plan_launch(
        recipe_path, [], recipe, nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="h0:29500"
    )
    assert "--nnodes 2" in static.command()
    assert "--rdzv-backend static --node-rank 1 --master-addr h0 --master-port 29500" in static.command()
    # a node waits torchrun's 900 s for the others unless told (launch.rdzv_timeout_s, --rdzv-timeout)
    assert "--rdzv-conf timeout=900 " in static.command()
    shorter = plan_launch(
        recipe_path, [], recipe, nproc_per_node=8, nnodes=2, rdzv_endpoint="h0:1", rdzv_timeout=30
    )
    assert "--node-rank 0 " in shorter.command() and "--rdzv-conf timeout=30 " in shorter.command()
    with pytest.raises(UserError, match="rdzv-endpoint"):
        plan_launch(recipe_path, [], recipe, nproc_per_node=8, nnodes=2)


def test_resuming_with_another_world_size_is_refused(tmp_path, two_rank_run):
    """A 2-rank checkpoint resumed on 1 rank would change the data plan and the RNG streams: it must
    stop with a user error (exit 2) that says why, not train a different run silently."""
    import shutil

    from hpref.train import run_train

    shutil.copytree(two_rank_run, tmp_path / "runs" / "ref")
    recipe = write_recipe(tmp_path, "ref")
    assert run_train(recipe, nproc_per_node=1, resume="auto") == 2
    log = (tmp_path / "runs" / "ref" / "logs" / "rank0.log").read_text()
    assert "written by 2 ranks, this run has 1" in log
