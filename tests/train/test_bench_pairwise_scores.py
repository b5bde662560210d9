"""The benchmark's two-way reading of hpref's three-way pairwise predictions (benchmarks/run.py)."""

from __future__ import annotations

import math

from benchmarks.run import pairwise_scores


def test_pairwise_scores_drop_the_tie_class_and_follow_the_winner(tmp_path):
    """Accuracy and log loss must be those of P(chosen) / (P(A) + P(B)), whichever side won. If this
    fails, the pairwise rows of RESULTS.md compare hpref with TRL on a different quantity (e.g. a
    tie argmax counted as an error, or the A column read as the winner's for B wins)."""
    (tmp_path / "predictions.csv").write_text(
        "id,winner_model_a,winner_model_b,winner_tie\n"
        "x,0.3,0.1,0.6\n"  # A won: two-way P = 0.75 -> right, although the tie is the argmax
        "y,0.5,0.3,0.2\n"  # B won: two-way P = 0.375 -> wrong
        "z,0.4,0.4,0.2\n"  # an exact tie (coarse bf16 logits): half right, whichever side won
    )
    got = pairwise_scores(tmp_path, {"x": 0, "y": 1, "z": 1})
    assert got["eval_accuracy_ab"] == 0.5
    assert math.isclose(got["eval_log_loss_ab"], (-math.log(0.75) - math.log(0.375) - math.log(0.5)) / 3)
