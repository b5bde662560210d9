"""Metrics on hand-computable inputs: every number here can be checked with a pencil."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hpref.evaluate.plots import PNG_SIGNATURE, matplotlib_available, reliability_diagram
from hpref.prediction import metrics as m

HARD = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=float)


def test_log_loss_of_uniform_is_ln3_on_hard_and_soft_labels():
    uniform = np.full((4, 3), 1 / 3)
    assert m.log_loss(uniform, HARD) == pytest.approx(math.log(3), abs=1e-12)
    soft = np.array([[0.5, 0.3, 0.2]] * 4)
    # cross-entropy of uniform against any distribution is ln 3: a different value means labels are mis-summed
    assert m.log_loss(uniform, soft) == pytest.approx(math.log(3), abs=1e-12)


def test_log_loss_on_soft_labels_is_cross_entropy():
    probs = np.array([[0.7, 0.2, 0.1]])
    labels = np.array([[0.5, 0.25, 0.25]])
    expected = -(0.5 * math.log(0.7) + 0.25 * math.log(0.2) + 0.25 * math.log(0.1))
    assert m.log_loss(probs, labels) == pytest.approx(expected, rel=1e-12)


def test_log_loss_clips_a_confident_mistake_to_a_finite_cost():
    probs = np.array([[1.0, 0.0, 0.0]])
    labels = np.array([[0.0, 1.0, 0.0]])
    loss = m.log_loss(probs, labels)
    # without clipping this is inf; Kaggle clips at 1e-15, so -ln(1e-15) ~ 34.54
    assert loss == pytest.approx(-math.log(1e-15), rel=1e-6)


def test_accuracy_and_confusion_matrix():
    probs = np.array([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1]])
    assert m.accuracy(probs, HARD) == pytest.approx(0.5)
    confusion = m.confusion_matrix(probs, HARD)
    # rows true, columns predicted: true b predicted a; true a (row 4) predicted b
    assert confusion.tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 1]]
    assert confusion.sum() == 4


def test_ece_is_zero_when_calibrated_and_the_gap_when_not():
    # 10 rows predicting p_a = 0.7 where A wins 7 times: bin 7 is perfectly calibrated for class a
    probs = np.tile([0.7, 0.2, 0.1], (10, 1))
    labels = np.array([[1, 0, 0]] * 7 + [[0, 1, 0]] * 2 + [[0, 0, 1]] * 1, dtype=float)
    cal = {c.name: c for c in m.class_calibration(probs, labels, bins=10)}
    assert cal["a"].ece == pytest.approx(0.0, abs=1e-12)
    assert cal["b"].ece == pytest.approx(0.0, abs=1e-12)
    assert cal["tie"].ece == pytest.approx(0.0, abs=1e-12)
    assert cal["a"].counts[7] == 10 and sum(cal["a"].counts) == 10
    # now A wins only 4 of 10: class a is over-confident by 0.3
    labels = np.array([[1, 0, 0]] * 4 + [[0, 1, 0]] * 5 + [[0, 0, 1]] * 1, dtype=float)
    cal = {c.name: c for c in m.class_calibration(probs, labels, bins=10)}
    assert cal["a"].ece == pytest.approx(0.3)
    assert cal["b"].ece == pytest.approx(0.3)  # predicted 0.2, observed 0.5
    assert cal["tie"].ece == pytest.approx(0.0, abs=1e-12)


def test_ece_puts_probability_one_in_the_last_bin():
    probs = np.array([[1.0, 0.0, 0.0]])
    cal = m.class_calibration(probs, np.array([[1.0, 0.0, 0.0]]), bins=5)
    assert cal[0].counts == [0, 0, 0, 0, 1]  # an off-by-one would drop it or raise


def test_bayes_floor_and_gap_closed():
    truth = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])
    labels = np.array([[1, 0, 0], [0, 1, 0]], dtype=float)
    floor = m.bayes_floor(truth, labels)
    assert floor == pytest.approx(-(math.log(0.6) + math.log(0.5)) / 2)
    assert m.gap_closed(floor, floor) == pytest.approx(1.0)
    assert m.gap_closed(math.log(3), floor) == pytest.approx(0.0)
    halfway = (math.log(3) + floor) / 2
    assert m.gap_closed(halfway, floor) == pytest.approx(0.5)
    metrics = m.compute_metrics(truth, labels, truth)
    assert metrics.gap_closed == pytest.approx(1.0)


def test_metrics_json_and_table(tmp_path):
    rng = np.random.default_rng(0)
    probs = rng.dirichlet([2, 2, 1], size=200)
    labels = np.eye(3)[[rng.choice(3, p=p) for p in probs]]
    metrics = m.compute_metrics(probs, labels, probs)
    metrics.extra["rows_per_s"] = 123.4
    path = m.write_metrics_json(tmp_path / "out" / "metrics.json", metrics, checkpoint="x")
    data = json.loads(path.read_text())
    assert data["n"] == 200 and data["checkpoint"] == "x" and data["rows_per_s"] == 123.4
    assert data["log_loss"] == pytest.approx(m.log_loss(probs, labels))
    assert sum(map(sum, data["confusion"])) == 200
    assert set(data["ece"]) == {"a", "b", "tie"}
    assert len(data["calibration"][0]["counts"]) == 10
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(m.metrics_table(metrics))
    text = console.export_text()
    assert "log loss" in text and "gap closed" in text and "rows per s" in text


def test_no_gap_closed_when_the_floor_is_above_uniform():
    # labels drawn against the truth: the "floor" exceeds ln 3 and a share of the gap means nothing
    truth = np.array([[0.9, 0.05, 0.05]] * 3)
    metrics = m.compute_metrics(np.full((3, 3), 1 / 3), np.array([[0, 1, 0]] * 3, dtype=float), truth)
    assert metrics.bayes_floor > math.log(3) and metrics.gap_closed is None


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"\[n, 3\]"):
        m.log_loss(np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="differ"):
        m.log_loss(np.ones((2, 3)) / 3, np.ones((3, 3)) / 3)


@pytest.mark.skipif(not matplotlib_available(), reason="matplotlib is not installed")
def test_reliability_diagram_writes_a_valid_png(tmp_path):
    rng = np.random.default_rng(1)
    probs = rng.dirichlet([2, 2, 1], size=300)
    labels = np.eye(3)[[rng.choice(3, p=p) for p in probs]]
    path = reliability_diagram(m.compute_metrics(probs, labels), tmp_path / "reliability.png")
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    from PIL import Image

    with Image.open(path) as image:
        image.verify()  # raises on a truncated or corrupt file
    with Image.open(path) as image:
        assert image.size[0] > 300 and image.size[1] > 300
    assert not (tmp_path / "reliability.png.part").exists()


def test_reliability_diagram_without_matplotlib_is_a_user_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    from hpref.errors import UserError

    metrics = m.compute_metrics(np.full((3, 3), 1 / 3), np.eye(3))
    with pytest.raises(UserError, match="pip install matplotlib"):
        reliability_diagram(metrics, tmp_path / "r.png")
