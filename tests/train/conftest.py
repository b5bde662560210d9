"""Tiny training runs for the engine tests: a 2-block, 32-wide Llama on 72 synthetic battles.

Every run folder lives under pytest's tmp dirs; the tokenizer cache is private to the session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import built_once

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

pytest.importorskip("torch")

RECIPE = """
[run]
name = "{name}"
output_dir = "{output_dir}"
seed = 0

[model]
name = "tiny-llama"
hidden_size = 32
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
intermediate_size = 64
vocab_size = 512
tokenizer_texts = 500
head_dropout = 0.0  # dropout draws differ by rank: a 1-rank and a 2-rank run would differ

[dataset.train]
name = "synthetic-arena"
num_battles = 96
folds = 4
split = "train"

[dataset.eval]
name = "synthetic-arena"
num_battles = 96
folds = 4
split = "eval"

[optimizer]
lr = 1e-3

[scheduler]
name = "linear"

[train]
epochs = 2
batch_size = 8
micro_batch_tokens = 1024
max_length = 512
precision = "fp32"
log_interval = 1
checkpoint_interval = 3
keep_checkpoints = 2
"""

#: the metric loggers the 2-rank runs also write to (`--log`), read back by test_metric_loggers.py
LOGGERS = ("tensorboard", "wandb")

#: 73 train battles (the eval fold holds 23) / 8 per step = 10 steps per epoch, 20 in all.
TOTAL_STEPS = 20


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))
    monkeypatch.delenv("HPREF_DEBUG_FAIL_RANK", raising=False)
    monkeypatch.delenv("HPREF_DEBUG_CRASH_AFTER_STEP", raising=False)


def write_recipe(folder: Path, name: str = "run") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.toml"
    path.write_text(RECIPE.format(name=name, output_dir=(folder / "runs").as_posix()))
    return path


def train_losses(run_dir: Path) -> dict[int, float]:
    """Step -> loss, checking that metrics.jsonl holds one train record per step (a resumed run
    replaces what the interrupted one wrote after its last checkpoint)."""
    from hpref.train.metrics import read_metrics

    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steps = [r["step"] for r in records]
    assert steps == sorted(set(steps)), f"metrics.jsonl repeats or reorders steps: {steps}"
    return {r["step"]: r["step_loss"] for r in records}


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """The uninterrupted 2-rank reference run, shared by the equivalence and resume tests of both
    test workers (built once: ~20 s of the suite each time)."""
    from hpref.train import run_train

    os.environ.setdefault("HPREF_CACHE", str(tmp_path_factory.getbasetemp() / "hpref-cache"))

    def build(folder: Path) -> None:
        recipe = write_recipe(folder, "ref")
        code = run_train(recipe, nproc_per_node=2, log=LOGGERS)  # rank 0 alone writes (test_metric_loggers)
        assert code == 0, "the 2-rank reference run failed; see its logs under " + str(folder)

    return built_once(tmp_path_factory, "two-rank", build) / "runs" / "ref"
