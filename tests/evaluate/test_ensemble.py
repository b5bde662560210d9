"""Blends, fitted weights and soft-label files (the distillation hand-off to the arena reader)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpref.arena import generate_battles
from hpref.data.readers import ArenaConfig, ArenaReader, write_arena_file
from hpref.errors import DataError, UserError
from hpref.evaluate import ensemble as ens
from hpref.prediction.files import Predictions, read_predictions, write_predictions
from hpref.prediction.metrics import log_loss


def _preds(ids, probs, source):
    return Predictions(list(ids), np.asarray(probs, dtype=float), source)


def test_blend_matches_rows_by_id_not_position():
    a = _preds(["x", "y"], [[0.6, 0.2, 0.2], [0.2, 0.6, 0.2]], "a.csv")
    b = _preds(["y", "x"], [[0.0, 0.9, 0.1], [0.9, 0.0, 0.1]], "b.csv")  # same ids, other order
    mixed = ens.blend([a, b], ens.parse_weights("2,1", 2))
    assert mixed.ids == ["x", "y"]
    # x: 2/3 * [.6,.2,.2] + 1/3 * [.9,0,.1]; pairing by position would give p_a = 0.4 instead of 0.7
    np.testing.assert_allclose(mixed.probs[0], [0.7, 0.4 / 3, 0.5 / 3], atol=1e-12)
    np.testing.assert_allclose(mixed.probs[1], [0.4 / 3, 0.7, 0.5 / 3], atol=1e-12)


def test_mismatched_ids_name_the_first_differing_id():
    a = _preds(["x", "y", "z"], np.full((3, 3), 1 / 3), "a.csv")
    b = _preds(["x", "z"], np.full((2, 3), 1 / 3), "b.csv")
    with pytest.raises(DataError, match=r"b.csv: has no prediction for id 'y', which a.csv has"):
        ens.blend([a, b])
    c = _preds(["x", "y", "z", "w"], np.full((4, 3), 1 / 3), "c.csv")
    with pytest.raises(DataError, match=r"c.csv: predicts id 'w', which a.csv does not"):
        ens.blend([a, c])


@pytest.mark.parametrize(
    ("text", "message"),
    [("1", "1 weights for 2"), ("1,x", "comma-separated"), ("0,0", "not all zero"), ("-1,2", "non-negative")],
)
def test_bad_weights_are_user_errors(text, message):
    with pytest.raises(UserError, match=message):
        ens.parse_weights(text, 2)


def _members(n=3000, seed=0):
    """A good member (the truth, slightly smoothed), a noisy one and an uninformed one."""
    rng = np.random.default_rng(seed)
    truth = rng.dirichlet([1.5, 1.5, 0.8], size=n)
    labels = np.eye(3)[[rng.choice(3, p=p) for p in truth]]
    noisy = 0.5 * truth + 0.5 * rng.dirichlet([1, 1, 1], size=n)
    ids = [str(i) for i in range(n)]
    members = [
        _preds(ids, 0.9 * truth + 0.1 / 3, "good"),
        _preds(ids, noisy, "noisy"),
        _preds(ids, np.full((n, 3), 1 / 3), "uniform"),
    ]
    return members, labels


def test_fitted_weights_beat_every_member_and_equal_weights_and_both_solvers_agree():
    members, labels = _members()
    w_eg = ens.fit_weights(members, labels, method="eg")
    w_scipy = ens.fit_weights(members, labels, method="scipy")
    assert w_eg.sum() == pytest.approx(1.0) and np.all(w_eg >= 0)
    # convex problem: two different solvers must land on the same optimum
    np.testing.assert_allclose(w_eg, w_scipy, atol=2e-3)
    assert w_eg[0] > 0.6  # most weight on the good member
    fitted = log_loss(ens.blend(members, w_eg).probs, labels)
    equal = log_loss(ens.blend(members).probs, labels)
    assert fitted < equal - 0.01
    for member in members:
        assert fitted <= log_loss(member.probs, labels) + 1e-9


def test_cross_fitted_blend_loss_is_honest_about_a_useless_member():
    """Weights fitted on the rows they are scored on flatter a blend; fitted on the other folds they
    do not. A member of pure noise on 200 rows must not look like a gain out of fold, while a
    useful member's gain must survive. If this fails, `hpref eval --fit-weights` tells a user that
    blending in a baseline helps when it cannot."""
    rng = np.random.default_rng(1)
    n = 200
    truth = rng.dirichlet([2, 2, 2], size=n)
    labels = np.eye(3)[[rng.choice(3, p=p) for p in truth]]
    ids = [str(i) for i in range(n)]
    model = _preds(ids, 0.7 * truth + 0.1, "model")
    noise = _preds(ids, rng.dirichlet([1, 1, 1], size=n), "noise")
    alone = log_loss(model.probs, labels)
    in_sample = log_loss(ens.blend([model, noise], ens.fit_weights([model, noise], labels)).probs, labels)
    out_of_fold = ens.cross_fitted_log_loss([model, noise], labels)
    assert in_sample <= alone + 1e-12  # the model alone is a feasible blend: in sample never worse
    assert out_of_fold > in_sample  # ... and out of fold the noise member costs something
    # two members that err independently: their blend is closer to the truth than either
    other = _preds(ids, 0.5 * truth + 0.5 * rng.dirichlet([1, 1, 1], size=n), "other")
    first = _preds(ids, 0.5 * truth + 0.5 * rng.dirichlet([1, 1, 1], size=n), "first")
    best_alone = min(log_loss(m.probs, labels) for m in (first, other))
    assert ens.cross_fitted_log_loss([first, other], labels) < best_alone - 0.01  # a real gain survives


def test_soft_labels_round_trip_through_the_arena_reader(tmp_path):
    """teacher predicts on unlabelled battles -> soft-label file -> `arena` reader -> same numbers."""
    battles = [dataclasses.replace(b, label=None) for b in generate_battles(40, seed=3)]
    unlabelled = write_arena_file(tmp_path / "test.csv", battles)
    read = ens.read_battles(unlabelled)
    assert all(b.label is None for b in read)
    rng = np.random.default_rng(0)
    teacher_a = write_predictions(
        tmp_path / "t1.csv", [b.id for b in read][::-1], rng.dirichlet([1, 1, 1], 40)
    )
    teacher_b = write_predictions(tmp_path / "t2.parquet", [b.id for b in read], rng.dirichlet([1, 1, 1], 40))
    blended = ens.blend([read_predictions(teacher_a), read_predictions(teacher_b)], [1, 3])
    for name in ("soft.csv", "soft.jsonl", "soft.parquet"):
        path = ens.write_soft_labels(tmp_path / name, blended, read)
        reader = ArenaReader(ArenaConfig(path=str(path)), seed=0)
        students = list(reader.battles())
        assert reader.labeled and len(students) == 40
        by_id = blended.index()
        got = np.array([s.label for s in students])
        want = blended.probs[[by_id[s.id] for s in students]]
        # write_arena_file's JSONL keeps pandas' default 10 significant digits; CSV/Parquet are exact
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9 if name.endswith("jsonl") else 1e-12)
        assert reader.summary.labels["soft"] == 40  # counted as soft labels, not rounded to hard ones
        assert [s.prompt for s in students] == [b.prompt for b in read]  # the text travels unchanged


def test_soft_labels_need_a_prediction_for_every_battle(tmp_path):
    battles = list(generate_battles(3, seed=1))
    preds = _preds([battles[0].id, battles[1].id], np.full((2, 3), 1 / 3), "t.csv")
    with pytest.raises(DataError, match=f"no prediction for battle '{battles[2].id}'"):
        ens.write_soft_labels(tmp_path / "s.csv", preds, battles)


def test_labels_for_scores_a_subset_and_refuses_unknown_ids():
    battles = list(generate_battles(5, seed=2))
    preds = _preds([battles[3].id, battles[1].id], np.full((2, 3), 1 / 3), "p.csv")
    labels, truth = ens.labels_for(preds, battles)
    np.testing.assert_allclose(labels, [battles[3].label, battles[1].label])
    np.testing.assert_allclose(truth, [battles[3].truth, battles[1].truth])
    with pytest.raises(DataError, match="'nope' is not in data"):
        ens.labels_for(_preds(["nope"], np.full((1, 3), 1 / 3), "p.csv"), battles)
