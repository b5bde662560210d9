"""Cheap baselines every preference model must beat, fitted on the train split, scored on eval.

A Kaggle LMSYS user reads a model's log loss against these, not against uniform: the *label prior*
(the train split's label shares for every battle: what any intercept learns), the *length* baseline
(a logistic regression on the answers' length differences: arena votes favour longer answers), a
*style* baseline (the same on how each answer is laid out: length, lines, list items, headers, bold
text, code blocks, an opening refusal; the answer-format signals LMSYS competitors fed their
feature models) and a *bag-of-words* baseline (on the difference of the two answers' word counts),
each with its penalty chosen by cross-validation on the train split (`fit_select`).
They need only the battles' text and labels, so they work on any data: a real arena file, chosen/
rejected pairs, or the synthetic arena (which adds its Bayes floor on top, `hpref.arena.source`).
numpy and torch only: scikit-learn is not a dependency.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from hpref.data.records import Battle
from hpref.prediction.metrics import log_loss

if TYPE_CHECKING:
    import torch  # imported where used: `hpref --help` loads this module and must not load torch


@dataclass(frozen=True)
class CheapBaselines:
    """Log losses (nats per battle) on the eval split; `bow` is None when it was not fitted."""

    n_train: int
    n_eval: int
    prior: float
    length: float
    style: float
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
    return score_baselines(
        baseline_probabilities(train, evaluation, bow=bow, max_vocab=max_vocab), len(train), evaluation
    )


def baseline_probabilities(
    train: Sequence[Battle], evaluation: Sequence[Battle], *, bow: bool = True, max_vocab: int = 1500
) -> dict[str, np.ndarray]:
    """Each cheap baseline's P(A), P(B), P(tie) `[n_eval, 3]` for `evaluation`, fitted on labelled
    `train`: "prior", "length", "style" and (when `bow`) "bow". A run writes them as prediction
    files, so a user can blend a model with them (`hpref eval --ensemble`)."""
    if not train or not evaluation:
        raise ValueError("the baselines need labelled battles in both the train and the eval split")
    y_train = labels_of(train)
    out = {"prior": np.tile(y_train.mean(axis=0), (len(evaluation), 1))}

    xl_train, xl_eval = length_features(train), length_features(evaluation)
    scale = xl_train.std(axis=0) + 1e-9
    w_len = fit_select(xl_train / scale, y_train, LENGTH_L2S)
    out["length"] = predict_logistic(w_len, xl_eval / scale)

    xs_train, xs_eval = style_features(train), style_features(evaluation)
    centre, scale = xs_train.mean(axis=0), xs_train.std(axis=0) + 1e-9
    w_style = fit_select((xs_train - centre) / scale, y_train, LENGTH_L2S)
    out["style"] = predict_logistic(w_style, (xs_eval - centre) / scale)

    if bow:
        counts: Counter[str] = Counter()
        for b in train:
            counts.update(set(_bow(b.response_a)) | set(_bow(b.response_b)))
        vocab = {tok: i for i, (tok, c) in enumerate(counts.most_common(max_vocab)) if c >= 3}
        xb_train, xb_eval = _bow_features(train, vocab), _bow_features(evaluation, vocab)
        w_bow = fit_select(xb_train, y_train, BOW_L2S)
        out["bow"] = predict_logistic(w_bow, xb_eval)
    return out


def score_baselines(
    probs: dict[str, np.ndarray], n_train: int, evaluation: Sequence[Battle]
) -> CheapBaselines:
    """`CheapBaselines` of `baseline_probabilities` on the labelled `evaluation` battles."""
    y_eval = labels_of(evaluation)
    bow = probs.get("bow")
    return CheapBaselines(
        n_train,
        len(evaluation),
        log_loss(probs["prior"], y_eval),
        log_loss(probs["length"], y_eval),
        log_loss(probs["style"], y_eval),
        None if bow is None else log_loss(bow, y_eval),
        tuple(float(s) for s in y_eval.mean(axis=0)),  # type: ignore[arg-type]
    )


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _with_bias(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The design matrix with a column of ones. Bag-of-words designs stay sparse (COO): a battle
    uses a few hundred words of a vocabulary of thousands, and dense, each pass streamed 22 MB (6 s
    of fits after a real HH run); sparse, the fits take a fraction of that."""
    import torch

    if isinstance(x, torch.Tensor) and x.is_sparse:
        coo = x.coalesce()
        n, d = x.shape
        rows = torch.arange(n)
        idx = torch.cat([coo.indices(), torch.stack([rows, torch.full((n,), d)])], dim=1)
        vals = torch.cat([coo.values(), torch.ones(n, dtype=coo.values().dtype)])
        return _sparse(idx, vals, (n, d + 1))
    dense = torch.as_tensor(np.asarray(x), dtype=torch.float32)
    return torch.cat([dense, torch.ones(len(dense), 1)], dim=1)


def _take(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    import torch

    index = torch.as_tensor(rows, dtype=torch.long)
    if x.is_sparse:
        return x.index_select(0, index).coalesce()
    return x[index]


def fit_logistic(x: np.ndarray | torch.Tensor, y: np.ndarray, l2: float, steps: int = 200) -> np.ndarray:
    """Multinomial logistic regression (weights [d+1, 3], last row the bias): the minimum of the
    mean cross-entropy plus l2·|W|² (bias not regularised) by full-batch L-BFGS, in float64. A convex
    problem solved to convergence, so the baseline is a number, not an artefact of the optimiser
    (full-batch Adam stopped early moved the HH bag-of-words figure by ±0.005 nats with the
    summation order). torch, since scikit-learn is not a dependency."""
    import torch

    xb = _with_bias(x).double()
    xt = xb.t().coalesce() if xb.is_sparse else xb.t().contiguous()
    if xb.is_sparse:
        with warnings.catch_warnings():  # "sparse CSR support is in beta": CSR @ dense is all we use
            warnings.simplefilter("ignore", UserWarning)
            xb, xt = xb.to_sparse_csr(), xt.to_sparse_csr()
    n = xb.shape[0]
    y_t = torch.as_tensor(y, dtype=torch.float64)
    w = torch.zeros(xb.shape[1], 3, dtype=torch.float64)
    mask = torch.ones(xb.shape[1], 1, dtype=torch.float64)
    mask[-1] = 0.0  # the bias is not regularised
    optimizer = torch.optim.LBFGS(
        [w],
        lr=1.0,
        max_iter=steps,
        history_size=20,
        tolerance_grad=1e-7,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )

    def objective() -> torch.Tensor:
        # the gradient by hand: autograd through a sparse product transposes it on every call
        logits = xb @ w
        logp = torch.log_softmax(logits, dim=1)
        loss = -(y_t * logp).sum(dim=1).mean() + l2 * ((w * mask) ** 2).sum()
        w.grad = xt @ (logp.exp() - y_t) / n + 2 * l2 * w * mask
        return loss

    optimizer.step(objective)
    return w.numpy()


def predict_logistic(w: np.ndarray, x: np.ndarray | torch.Tensor) -> np.ndarray:
    import torch

    return torch.softmax(_with_bias(x).double() @ torch.as_tensor(w, dtype=torch.float64), dim=1).numpy()


#: l2 strengths the baselines choose from by cross-validation; the largest shrinks every weight to
#: about zero, i.e. the label prior, so a baseline whose features only add noise falls back to it
#: instead of printing worse than uniform (the bag-of-words on 999 long LMSYS battles did: 1.33)
LENGTH_L2S = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
BOW_L2S = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
CV_FOLDS = 5


def fit_select(
    x_train: np.ndarray | torch.Tensor, y_train: np.ndarray, l2s: Iterable[float], folds: int = CV_FOLDS
) -> np.ndarray:
    """Pick l2 by `folds`-fold cross-validation on the train split (battle i in fold i mod folds;
    the lowest mean held-out log loss), then refit on all of it. One held-out fifth, as before, let
    a lucky fifth choose a weak penalty that then overfitted the eval split."""
    import torch

    n = len(y_train)
    folds = max(2, min(folds, n))
    if not isinstance(x_train, torch.Tensor):
        x_train = torch.as_tensor(np.asarray(x_train), dtype=torch.float32)
    order = np.arange(n)
    splits = [(order[order % folds != k], order[order % folds == k]) for k in range(folds)]

    def cv_loss(l2: float) -> float:
        losses = [
            log_loss(
                predict_logistic(fit_logistic(_take(x_train, fit), y_train[fit], l2), _take(x_train, held)),
                y_train[held],
            )
            * len(held)
            for fit, held in splits
        ]
        return sum(losses) / n

    with single_thread():
        best = min(l2s, key=cv_loss)
        return fit_logistic(x_train, y_train, best)


@contextlib.contextmanager
def single_thread():
    """Small matrices: threads only contend (5x slower on a busy 2-core box)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


# an answer that opens by declining (looked for in its first 300 characters)
_REFUSAL = re.compile(
    r"\b(i'm sorry|i am sorry|i apologi[sz]e|i cannot|i can't|as an ai|i'm not able|i am not able|"
    r"i'm unable|i am unable)\b",
    re.IGNORECASE,
)
_LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s", re.MULTILINE)
_HEADER = re.compile(r"^#{1,6}\s", re.MULTILINE)


def _layout(turns: Sequence[str]) -> list[float]:
    """How one answer (all its turns) is laid out: log1p of its characters, words, line breaks,
    list items, markdown headers, bold markers and code fences, and 1.0 if it opens by declining."""
    text = "\n".join(turns)
    counts = (
        len(text),
        len(text.split()),
        text.count("\n"),
        len(_LIST_ITEM.findall(text)),
        len(_HEADER.findall(text)),
        text.count("**"),
        text.count("```"),
    )
    return [math.log1p(c) for c in counts] + [float(_REFUSAL.search(text[:300]) is not None)]


def style_features(battles: Sequence[Battle]) -> np.ndarray:
    """Per battle: the `_layout` of A minus B's (who wins), its absolute value and their sum (how
    alike and how long both are: close or both-short answers draw ties), whether both decline,
    and whether the two answers are the same text."""
    rows = []
    for b in battles:
        a, c = np.array(_layout(b.response_a)), np.array(_layout(b.response_b))
        same = "\n".join(b.response_a).strip() == "\n".join(b.response_b).strip()
        rows.append(np.concatenate([a - c, np.abs(a - c), a + c, [a[-1] * c[-1], float(same)]]))
    return np.array(rows, dtype=np.float64)


_TOKEN = re.compile(r"\w+|[^\w\s]")


def _bow(turns: Sequence[str]) -> Counter[str]:
    return Counter(tok.lower() for t in turns for tok in _TOKEN.findall(t))


def _bow_features(battles: Sequence[Battle], vocab: dict[str, int]) -> torch.Tensor:
    """[n, 2 x vocab], sparse: per word, the signed log of A's count minus B's (sign(d) log(1 + |d|)),
    then its absolute value. Raw differences of long answers run into the tens and let one word of a
    thousand-word answer outweigh the rest; the log keeps a word's weight in proportion."""
    import torch

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, b in enumerate(battles):
        diff = _bow(b.response_a)
        diff.subtract(_bow(b.response_b))
        for tok, count in diff.items():
            j = vocab.get(tok)
            if j is not None and count:
                size = math.log1p(abs(count))
                rows += (i, i)
                cols += (j, len(vocab) + j)
                vals += (math.copysign(size, count), size)
    index = torch.tensor([rows, cols], dtype=torch.long).reshape(2, -1)
    values = torch.tensor(vals, dtype=torch.float32)
    return _sparse(index, values, (len(battles), 2 * len(vocab)))


def _sparse(index: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    import torch

    # built from our own valid indices: torch's invariant checks would only cost time
    return torch.sparse_coo_tensor(index, values, shape, check_invariants=False).coalesce()
