"""Scores of predicted (p_a, p_b, p_tie) distributions against labels, numpy only.

Labels may be hard (one-hot) or soft (any distribution, e.g. teacher predictions); every metric is
defined for both. Conventions, chosen to match what the Kaggle LMSYS leaderboard computed:

- log loss clips each probability to [eps, 1 - eps] and renormalises the row before the log, so one
  confident mistake costs ln(1/eps) ~ 34.5 nats instead of infinity, as Kaggle's scorer does;
- accuracy and the confusion matrix use the argmax of the label (for soft labels: its most likely
  class), ties broken towards the lower class index (a, then b, then tie), like numpy's argmax;
- calibration error is per class ("is p_tie = 0.3 right 30% of the time?"), with equal-width bins,
  because a single top-label ECE hides the tie class, the one preference models get wrong most;
- on data with known outcome probabilities (`truth`, the synthetic arena) the Bayes floor is the log
  loss of predicting the truth itself, and "gap closed" is the share of the distance from uniform
  guessing (ln 3) to that floor a model covers: 0 = no better than uniform, 1 = Bayes-optimal.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpref.data.records import LABELS

CLASS_NAMES = ("a", "b", "tie")
UNIFORM_LOG_LOSS = math.log(3)
EPS = 1e-15


def _as_matrix(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"{name} must have shape [n, 3], got {arr.shape}")
    return arr


def _check_pair(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    p, y = _as_matrix(probs, "probs"), _as_matrix(labels, "labels")
    if p.shape != y.shape:
        raise ValueError(f"probs {p.shape} and labels {y.shape} differ in shape")
    if len(p) == 0:
        raise ValueError("no rows to score")
    return p, y


def clip_normalise(probs: Any, eps: float = EPS) -> np.ndarray:
    """Clip to [eps, 1 - eps] and renormalise rows (Kaggle's log-loss preprocessing)."""
    p = np.clip(_as_matrix(probs, "probs"), eps, 1.0 - eps)
    return p / p.sum(axis=1, keepdims=True)


def per_row_log_loss(probs: Any, labels: Any, eps: float = EPS) -> np.ndarray:
    """Cross-entropy of each row: -sum_c label_c * log p_c (nats)."""
    p, y = _check_pair(probs, labels)
    return -(y * np.log(clip_normalise(p, eps))).sum(axis=1)


def log_loss(probs: Any, labels: Any, eps: float = EPS) -> float:
    """Mean cross-entropy against hard or soft labels, after clipping (see the module docstring)."""
    return float(per_row_log_loss(probs, labels, eps).mean())


def accuracy(probs: Any, labels: Any) -> float:
    """Share of rows whose most likely predicted class is the label's most likely class."""
    p, y = _check_pair(probs, labels)
    return float((p.argmax(axis=1) == y.argmax(axis=1)).mean())


def confusion_matrix(probs: Any, labels: Any) -> np.ndarray:
    """[3, 3] counts: row = true class (label argmax), column = predicted class (a, b, tie)."""
    p, y = _check_pair(probs, labels)
    matrix = np.zeros((3, 3), dtype=np.int64)
    np.add.at(matrix, (y.argmax(axis=1), p.argmax(axis=1)), 1)
    return matrix


@dataclass
class ClassCalibration:
    """Equal-width reliability bins of one class. Empty bins have count 0 and NaN means."""

    name: str
    ece: float
    bin_edges: list[float]
    counts: list[int]
    mean_predicted: list[float]
    mean_observed: list[float]


def class_calibration(probs: Any, labels: Any, bins: int = 10) -> list[ClassCalibration]:
    """Per-class expected calibration error: sum over bins of (n_bin / n) |mean p - mean label|.

    Bin k holds predictions in [k/bins, (k+1)/bins), the last bin also holds 1.0. The observed
    frequency is the mean label value, so soft labels count fractionally, as their expectation.
    """
    if bins < 1:
        raise ValueError("bins must be at least 1")
    p, y = _check_pair(probs, labels)
    n = len(p)
    edges = np.linspace(0.0, 1.0, bins + 1)
    out = []
    for c, name in enumerate(CLASS_NAMES):
        index = np.clip((p[:, c] * bins).astype(np.int64), 0, bins - 1)
        counts = np.bincount(index, minlength=bins)
        sum_p = np.bincount(index, weights=p[:, c], minlength=bins)
        sum_y = np.bincount(index, weights=y[:, c], minlength=bins)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_p = sum_p / counts
            mean_y = sum_y / counts
        used = counts > 0
        ece = float((counts[used] / n * np.abs(mean_p[used] - mean_y[used])).sum())
        out.append(
            ClassCalibration(
                name=name,
                ece=ece,
                bin_edges=[float(e) for e in edges],
                counts=[int(k) for k in counts],
                mean_predicted=[float(v) for v in mean_p],
                mean_observed=[float(v) for v in mean_y],
            )
        )
    return out


def bayes_floor(truth: Any, labels: Any) -> float:
    """The log loss of predicting the generating distribution itself: no model can expect lower."""
    return log_loss(truth, labels)


def gap_closed(model_log_loss: float, floor: float, uniform: float = UNIFORM_LOG_LOSS) -> float:
    """Share of the uniform -> floor gap a model covers (1 = Bayes-optimal, 0 = uniform, < 0 worse)."""
    if uniform - floor <= 0:
        raise ValueError(f"the floor {floor:.4f} is not below uniform {uniform:.4f}; the gap is undefined")
    return (uniform - model_log_loss) / (uniform - floor)


@dataclass
class EvalMetrics:
    """Everything `hpref eval` reports for labelled data."""

    n: int
    log_loss: float
    accuracy: float
    ece: dict[str, float]
    confusion: list[list[int]]
    label_shares: list[float]
    predicted_shares: list[float]
    calibration: list[ClassCalibration] = field(repr=False)
    bayes_floor: float | None = None
    gap_closed: float | None = None
    uniform: float = UNIFORM_LOG_LOSS
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_ece(self) -> float:
        return float(np.mean(list(self.ece.values())))

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mean_ece"] = self.mean_ece
        out["labels"] = list(LABELS)
        out["confusion_axes"] = "rows = true class, columns = predicted class, order a, b, tie"
        extra = out.pop("extra")
        out.update(extra)
        return out


def compute_metrics(probs: Any, labels: Any, truth: Any | None = None, *, bins: int = 10) -> EvalMetrics:
    """All metrics at once; `truth` (the generating distributions, when known) adds the floor."""
    p, y = _check_pair(probs, labels)
    calibration = class_calibration(p, y, bins)
    floor = closed = None
    if truth is not None:
        t = _as_matrix(truth, "truth")
        if t.shape != p.shape:
            raise ValueError(f"truth {t.shape} and probs {p.shape} differ in shape")
        floor = bayes_floor(t, y)
    loss = log_loss(p, y)
    if floor is not None and floor < UNIFORM_LOG_LOSS:  # a tiny or unlucky split can have no gap
        closed = gap_closed(loss, floor)
    return EvalMetrics(
        n=len(p),
        log_loss=loss,
        accuracy=accuracy(p, y),
        ece={c.name: c.ece for c in calibration},
        confusion=confusion_matrix(p, y).tolist(),
        label_shares=[float(v) for v in y.mean(axis=0)],
        predicted_shares=[float(v) for v in p.mean(axis=0)],
        calibration=calibration,
        bayes_floor=floor,
        gap_closed=closed,
    )


def write_metrics_json(path: str | Path, metrics: EvalMetrics, **extra: Any) -> Path:
    """The metrics as JSON, written atomically (a reader never sees half a file)."""
    from hpref.runfolder.files import write_json_atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**metrics.as_dict(), **extra}
    return write_json_atomic(path, data, indent=2, default=_json_default, allow_nan=True)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def metrics_rows(metrics: EvalMetrics) -> list[tuple[str, str]]:
    """(name, value) pairs in the order the table prints them."""
    rows = [
        ("battles", f"{metrics.n:,}"),
        ("log loss", f"{metrics.log_loss:.4f}"),
        ("accuracy", f"{metrics.accuracy:.3f}"),
        ("ECE a / b / tie", " / ".join(f"{metrics.ece[c]:.3f}" for c in CLASS_NAMES)),
        ("label shares a / b / tie", " / ".join(f"{v:.3f}" for v in metrics.label_shares)),
        ("predicted shares a / b / tie", " / ".join(f"{v:.3f}" for v in metrics.predicted_shares)),
        ("uniform (ln 3)", f"{metrics.uniform:.4f}"),
    ]
    if metrics.bayes_floor is not None and metrics.gap_closed is not None:
        rows.append(("Bayes floor", f"{metrics.bayes_floor:.4f}"))
        rows.append(("gap closed (uniform -> floor)", f"{metrics.gap_closed:.1%}"))
    for key, value in metrics.extra.items():
        rows.append((key.replace("_", " "), f"{value:,.1f}" if isinstance(value, float) else str(value)))
    return rows


def metrics_table(metrics: EvalMetrics, title: str = "hpref eval") -> Any:
    """A rich table of the metrics and, below it, the confusion matrix."""
    from rich.console import Group
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for name, value in metrics_rows(metrics):
        table.add_row(name, value)
    confusion = Table(title="confusion (rows: true, columns: predicted)", title_justify="left")
    confusion.add_column("")
    for name in CLASS_NAMES:
        confusion.add_column(name, justify="right")
    for name, row in zip(CLASS_NAMES, metrics.confusion, strict=True):
        confusion.add_row(name, *(f"{v:,}" for v in row))
    return Group(table, confusion)
