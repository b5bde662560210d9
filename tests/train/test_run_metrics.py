"""What a user reads after `hpref train`: the fields of `metrics.jsonl` and `summary.json`, checked on
the shared 2-rank tiny run (tests/train/conftest.py) for presence, type and numbers that agree with
each other and with the data the run trained on."""

from __future__ import annotations

import json
import math
import re

import pytest

from .conftest import TOTAL_STEPS

#: the run's model (tests/train/conftest.py RECIPE): 2 blocks, 32 wide, 512-token vocabulary
LAYERS, HIDDEN, VOCAB, MAX_LENGTH = 2, 32, 512, 512
TRAIN_FLOAT_FIELDS = (
    "loss",
    "step_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "mfu",
    "step_time_s",
    "peak_memory_gib",
    "seconds",
    "flops",
)


def _records(run_dir):
    from hpref.train.metrics import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    return [r for r in records if r["kind"] == "train"], [r for r in records if r["kind"] == "eval"]


def _dataset_tokens(run_dir) -> int:
    """The train split's token count, as the run logged it at start ("data: ... N tokens")."""
    text = (run_dir / "logs" / "rank0.log").read_text()
    return int(
        re.search(r"data: \d+ train battles \(\d+ sequences, ([\d,]+) tokens\)", text)[1].replace(",", "")
    )


def _eval_battles(run_dir):
    from hpref.plugins import load_plugins
    from hpref.recipe import load_recipe

    recipe = load_recipe(run_dir / "recipe.toml")
    source = load_plugins().get("dataset", recipe.dataset.eval.name)
    return list(source.build(recipe.dataset.eval.config, recipe.run.seed).battles())


def _peak_flops(summary) -> tuple[float, float]:
    """The MFU denominator the summary states ("0.33 TFLOP/s (...)"), in FLOP/s, and the relative
    error of its 2-digit rounding (the tolerance of an MFU recomputed from it)."""
    tflops = float(re.match(r"([\d.]+) TFLOP/s", summary["peak"])[1])
    return tflops * 1e12, 0.005 / tflops


def test_every_train_record_is_typed_and_its_throughput_adds_up(two_rank_run):
    """One train record per step (log_interval = 1), each with every field typed and finite; tokens/s
    is tokens over seconds, per device half of it on 2 ranks; each epoch's tokens are the train
    split's tokens (all ranks counted, nothing twice); FLOPs per token lie between 6 x the
    non-embedding parameters and 6 x all parameters plus the attention term at max_length; MFU is
    FLOPs / seconds / ranks / the stated peak; peak memory is a CPU process's RSS. A wrong factor
    (a rank's tokens, a missing x2 for ranks, an MFU against another peak) fails here."""
    train, _ = _records(two_rank_run)
    summary = json.loads((two_rank_run / "summary.json").read_text())
    assert [r["step"] for r in train] == list(range(1, TOTAL_STEPS + 1))
    params, (peak, rounding) = summary["params"], _peak_flops(summary)
    for r in train:
        assert isinstance(r["step"], int) and isinstance(r["epoch"], int) and isinstance(r["tokens"], int)
        for key in TRAIN_FLOAT_FIELDS:
            assert isinstance(r[key], float) and math.isfinite(r[key]), (key, r)
        assert r["tokens"] > 0 and r["seconds"] > 0 and r["step_time_s"] == pytest.approx(r["seconds"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-9)
        assert r["tokens_per_s_per_device"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-9)
        per_token = r["flops"] / r["tokens"]
        assert 6 * (params - VOCAB * HIDDEN) <= per_token <= 6 * params + 12 * LAYERS * HIDDEN * MAX_LENGTH
        assert r["mfu"] == pytest.approx(r["flops"] / r["seconds"] / 2 / peak, rel=rounding)
        assert 0 < r["mfu"] < 1
        assert 0.05 < r["peak_memory_gib"] < 64
        assert 0 < r["loss"] < 3 and r["grad_norm"] >= 0 and r["lr"] >= 0
    tokens = _dataset_tokens(two_rank_run)
    for epoch in (0, 1):
        assert sum(r["tokens"] for r in train if r["epoch"] == epoch) == tokens


def test_eval_records_and_the_summary_agree_with_the_predictions(two_rank_run):
    """An eval record per epoch (eval_interval = 1) with log loss and accuracy that the written
    predictions reproduce; summary.json's totals are the records' (tokens/s = all tokens / all train
    seconds, MFU likewise), its eval is the last one, its wall time covers the train seconds, its
    parameter count is the model's, and its gap_closed is (uniform - eval) / (uniform - Bayes floor).
    If a field is missing, renamed or computed from another interval, a user's reading is wrong."""
    import numpy as np

    from hpref.prediction.files import read_predictions
    from hpref.prediction.metrics import accuracy, log_loss

    train, evals = _records(two_rank_run)
    summary = json.loads((two_rank_run / "summary.json").read_text())
    assert [e["step"] for e in evals] == [10, 20] and [e["epoch"] for e in evals] == [0, 1]
    for e in evals:
        assert isinstance(e["eval_battles"], int) and e["eval_battles"] == 23
        assert 0 < e["eval_log_loss"] < 3 and e["eval_seconds"] > 0
        assert e["eval_accuracy"] * 23 == pytest.approx(round(e["eval_accuracy"] * 23))  # k of 23 battles
    last = evals[-1]
    predictions = read_predictions(two_rank_run / "predictions" / "step-000020.csv")
    labels = {b.id: b.label for b in _eval_battles(two_rank_run)}
    truth = np.array([labels[i] for i in predictions.ids])
    assert last["eval_log_loss"] == pytest.approx(log_loss(predictions.probs, truth), abs=1e-9)
    assert last["eval_accuracy"] == pytest.approx(accuracy(predictions.probs, truth), abs=1e-12)

    seconds, tokens, flops = (sum(r[k] for r in train) for k in ("seconds", "tokens", "flops"))
    assert (summary["steps"], summary["total_steps"], summary["world_size"]) == (TOTAL_STEPS, TOTAL_STEPS, 2)
    assert summary["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-6)
    peak, rounding = _peak_flops(summary)
    assert summary["mfu"] == pytest.approx(flops / seconds / 2 / peak, rel=rounding)
    assert summary["wall_s"] > seconds
    assert summary["train_loss"] == pytest.approx(train[-1]["loss"])
    assert summary["peak_memory_gib"] >= max(r["peak_memory_gib"] for r in train) - 1e-9
    assert summary["trainable_params"] == summary["params"] == 36_131  # full fine-tuning of the tiny model
    assert (summary["eval_step"], summary["eval_log_loss"], summary["eval_accuracy"]) == (
        20,
        last["eval_log_loss"],
        last["eval_accuracy"],
    )
    baselines = summary["baselines"]
    assert baselines["bayes_floor"] < baselines["uniform"] == pytest.approx(math.log(3))
    closed = (baselines["uniform"] - summary["eval_log_loss"]) / (
        baselines["uniform"] - baselines["bayes_floor"]
    )
    assert summary["gap_closed"] == pytest.approx(closed)
