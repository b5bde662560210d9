"""Cheap baselines every preference model must beat, fitted on the train split, scored on eval.

A Kaggle LMSYS user reads a model's log loss against these, not against uniform: the *label prior*
(the train split's label shares for every battle: what any intercept learns), the *length* baseline
(a logistic regression on the answers' length differences: arena votes favour longer answers) and a
*bag-of-words* baseline (a logistic regression on the difference of the two answers' word counts).
They need only the battles' text and labels, so they work on any data: a real arena file, chosen/
rejected pairs, or the synthetic arena (which adds its Bayes floor on top, `hpref.data.synthetic`).
numpy only: scikit-learn is not a dependency.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from hpref.data.records import Battle


@dataclass(frozen=True)
class CheapBaselines:
    """Log losses (nats per battle) on the eval split; `bow` is None when it was not fitted."""

    n_train: int
    n_eval: int
    prior: float
    length: float
    bow: float | None
    label_shares: tuple[float, float, float]  # of the eval split

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def labels_of(battles: Sequence[Battle]) -> np.ndarray:
    return np.array([b.label for b in battles], dtype=np.float64)


def cheap_baselines(
    train: Sequence[Battle], evaluation: Sequence[Battle], *, bow: bool = True, max_vocab: int = 1500
) -> CheapBaselines:
    """Fit the baselines on labelled `train` battles and score them on labelled `evaluation`."""
    if not train or not evaluation:
        raise ValueError("the baselines need labelled battles in both the train and the eval split")
    y_train, y_eval = labels_of(train), labels_of(evaluation)
    prior = log_loss(np.tile(y_train.mean(axis=0), (len(evaluation), 1)), y_eval)

    xl_train, xl_eval = length_features(train), length_features(evaluation)
    scale = xl_train.std(axis=0) + 1e-9
    w_len = fit_select(xl_train / scale, y_train, (1e-4, 1e-3, 1e-2))
    length = log_loss(predict_logistic(w_len, xl_eval / scale), y_eval)

    bow_loss = None
    if bow:
        counts: Counter[str] = Counter()
        for b in train:
            counts.update(set(_bow(b.response_a)) | set(_bow(b.response_b)))
        vocab = {tok: i for i, (tok, c) in enumerate(counts.most_common(max_vocab)) if c >= 3}
        xb_train, xb_eval = _bow_features(train, vocab), _bow_features(evaluation, vocab)
        w_bow = fit_select(xb_train, y_train, (1e-3, 1e-2, 1e-1))
        bow_loss = log_loss(predict_logistic(w_bow, xb_eval), y_eval)
    shares = tuple(float(s) for s in y_eval.mean(axis=0))
    return CheapBaselines(len(train), len(evaluation), prior, length, bow_loss, shares)  # type: ignore[arg-type]


def log_loss(probs: np.ndarray, labels: np.ndarray) -> float:
    """Mean cross-entropy of predicted distributions against (hard or soft) labels."""
    return float(-(labels * np.log(np.clip(probs, 1e-12, 1.0))).sum(axis=1).mean())


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float, steps: int = 300, lr: float = 0.1) -> np.ndarray:
    """Multinomial logistic regression (weights [d+1, 3], last row the bias) by full-batch Adam on
    the mean cross-entropy plus l2·|W|²; numpy only, since scikit-learn is not a dependency."""
    n, d = x.shape
    xb = np.hstack([x, np.ones((n, 1))]).astype(np.float32)
    y = y.astype(np.float32)
    w = np.zeros((d + 1, 3), dtype=np.float32)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    mask = np.ones_like(w)
    mask[-1] = 0.0  # the bias is not regularised
    for t in range(1, steps + 1):
        p = _softmax(xb @ w)
        grad = xb.T @ (p - y) / n + 2 * l2 * w * mask
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad**2
        w -= lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return w


def predict_logistic(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return _softmax(np.hstack([x, np.ones((len(x), 1))]) @ w)


def fit_select(x_train: np.ndarray, y_train: np.ndarray, l2s: Iterable[float]) -> np.ndarray:
    """Pick l2 on a held-out fifth of the train split (shorter fits), then refit on all of it."""
    n = len(x_train)
    cut = max(1, n // 5)
    with single_thread():
        best = min(
            l2s,
            key=lambda l2: log_loss(
                predict_logistic(fit_logistic(x_train[cut:], y_train[cut:], l2, steps=150), x_train[:cut]),
                y_train[:cut],
            ),
        )
        return fit_logistic(x_train, y_train, best)


@contextlib.contextmanager
def single_thread():
    """Small matrices: BLAS threads only contend (5x slower on a busy 2-core box). threadpoolctl is
    optional; without it the fit just runs with the default thread count."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(1):
        yield


def length_features(battles: Sequence[Battle]) -> np.ndarray:
    rows = []
    for b in battles:
        la = sum(len(t) for t in b.response_a)
        lb = sum(len(t) for t in b.response_b)
        wa = sum(len(t.split()) for t in b.response_a)
        wb = sum(len(t.split()) for t in b.response_b)
        d = math.log1p(la) - math.log1p(lb)
        dw = (wa - wb) / 10.0
        rows.append((d, abs(d), dw, abs(dw), d * d))
    return np.array(rows, dtype=np.float64)


_TOKEN = re.compile(r"\w+|[^\w\s]")


def _bow(turns: Sequence[str]) -> Counter[str]:
    return Counter(tok.lower() for t in turns for tok in _TOKEN.findall(t))


def _bow_features(battles: Sequence[Battle], vocab: dict[str, int]) -> np.ndarray:
    x = np.zeros((len(battles), 2 * len(vocab)))
    for i, b in enumerate(battles):
        diff = _bow(b.response_a)
        diff.subtract(_bow(b.response_b))
        for tok, count in diff.items():
            j = vocab.get(tok)
            if j is not None and count:
                x[i, j] = count
                x[i, len(vocab) + j] = abs(count)
    return x
