"""Swap TTA with a deliberately position-biased fake judge: the bias must cancel.

TTA is the shared `hpref.prediction.predict` over both views of each battle
(`hpref.data.cache.encode_views(..., both_views=True)`), the path `hpref eval --tta swap` takes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hpref.data.cache import encode_views
from hpref.data.records import Battle
from hpref.prediction.metrics import log_loss
from hpref.prediction.predict import combine_views, predict, unswap

BIAS = 0.8  # the fake judge adds this to the logit of whichever answer is shown first
NU = 0.8


def davidson(u_first, u_second, bias=0.0):
    z = np.array([u_first + bias, u_second, math.log(NU) + (u_first + u_second) / 2])
    e = np.exp(z - z.max())
    return e / e.sum()


def make_battles(n, seed=0):
    rng = np.random.default_rng(seed)
    battles = []
    for i in range(n):
        ua, ub = rng.integers(0, 6, size=2)
        truth = tuple(davidson(ua, ub))
        label = tuple(np.eye(3)[rng.choice(3, p=truth)])
        battles.append(Battle(str(i), ("q",), (f"u={ua}",), (f"u={ub}",), label=label, truth=truth))
    return battles


class UtilityFormatter:
    """[first answer's utility, second answer's utility, a separator] as token ids."""

    def encode(self, battle):
        return [int(battle.response_a[0][2:]) + 10, int(battle.response_b[0][2:]) + 10, 3]


class BiasedJudge(torch.nn.Module):
    """Reads each packed sequence's two utilities and favours the first answer by BIAS."""

    def forward(self, input_ids, cu_seqlens, position_ids, *, max_seqlen=None):
        out = []
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
            if end - start < 2:  # a filler
                out.append([1 / 3, 1 / 3, 1 / 3])
                continue
            out.append(davidson(int(input_ids[start]) - 10, int(input_ids[start + 1]) - 10, BIAS))
        return torch.log(torch.tensor(np.array(out), dtype=torch.float32))  # logits whose softmax is out


def predict_with_swap_tta(battles, *, tta):
    examples = encode_views(battles, UtilityFormatter(), both_views=tta).examples()
    return predict(BiasedJudge(), examples, n_rows=len(battles), micro_batch_tokens=64).probs


def test_unswap_exchanges_a_and_b():
    np.testing.assert_array_equal(unswap([[0.6, 0.3, 0.1]]), [[0.3, 0.6, 0.1]])


def test_combine_views_averages_mapped_views_and_refuses_lost_rows():
    probs = [[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.5, 0.5, 0.0]]
    # row 0 seen twice: as is, and swapped (0.2, 0.5, 0.3) -> (0.5, 0.2, 0.3); row -1 is a filler
    out = combine_views([0, 0, -1], [False, True, False], probs, 1)
    np.testing.assert_allclose(out, [[0.55, 0.25, 0.2]])
    with pytest.raises(RuntimeError, match="no scored view"):
        combine_views([0], [False], [[1, 0, 0]], 2)


def test_swap_tta_removes_the_position_bias_and_lowers_log_loss():
    battles = make_battles(600)
    plain = predict_with_swap_tta(battles, tta=False)
    tta = predict_with_swap_tta(battles, tta=True)
    labels = np.array([b.label for b in battles])
    equal = [i for i, b in enumerate(battles) if b.response_a == b.response_b]
    assert len(equal) > 50
    # identical answers: the biased judge prefers A by a wide margin; TTA makes A and B exactly equal
    assert (plain[equal, 0] - plain[equal, 1]).mean() > 0.2
    np.testing.assert_allclose(tta[equal, 0], tta[equal, 1], atol=1e-6)
    # over all battles: mean p_a - p_b matches the truth's with TTA (the bias is gone, not just smaller)
    truth = np.array([b.truth for b in battles])
    true_gap = (truth[:, 0] - truth[:, 1]).mean()
    assert (plain[:, 0] - plain[:, 1]).mean() - true_gap > 0.15
    assert abs((tta[:, 0] - tta[:, 1]).mean() - true_gap) < 0.01
    assert log_loss(tta, labels) < log_loss(plain, labels) - 0.02
    np.testing.assert_allclose(tta.sum(axis=1), 1.0, atol=1e-6)
