"""Blend weights for a mixture of probability predictions, fitted by log loss.

A blend is the weighted arithmetic mean of the members' P(A), P(B), P(tie) (a mixture): its log loss
is convex in the weights, so the fitted weights are a global optimum. Arrays only (`probs [k, n, 3]`,
`labels [n, 3]`): `hpref eval --ensemble` fits prediction files with them (`hpref.evaluate.ensemble`),
and a training run's summary blends its model with its cheap baselines (`hpref.train.summary`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from hpref.prediction.metrics import EPS, log_loss

FitMethod = Literal["auto", "scipy", "eg"]


def _mixture_loss_and_grad(w: np.ndarray, probs: np.ndarray, labels: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of the mixture sum_k w_k probs_k, and its gradient in w."""
    mixed = np.clip(np.tensordot(w, probs, axes=1), EPS, None)  # [n, 3]
    loss = float(-(labels * np.log(mixed)).sum(axis=1).mean())
    ratio = labels / mixed  # [n, 3]
    grad = -(probs * ratio[None]).sum(axis=2).mean(axis=1)  # [k]
    return loss, grad


def _fit_eg(probs: np.ndarray, labels: np.ndarray, steps: int = 2000, lr: float = 0.5) -> np.ndarray:
    """Exponentiated gradient on the simplex: w <- w * exp(-lr * grad), renormalised.

    The multiplicative update keeps every weight positive and the sum at one without a projection.
    The gradient of the mixture loss is bounded by max(labels / mixed), so a fixed step converges;
    the step is halved whenever the loss goes up (a safety net for near-degenerate members).
    """
    k = probs.shape[0]
    w = np.full(k, 1.0 / k)
    loss, grad = _mixture_loss_and_grad(w, probs, labels)
    for _ in range(steps):
        candidate = w * np.exp(-lr * (grad - grad.min()))
        candidate /= candidate.sum()
        new_loss, new_grad = _mixture_loss_and_grad(candidate, probs, labels)
        if new_loss > loss + 1e-15:
            lr /= 2
            if lr < 1e-8:
                break
            continue
        converged = loss - new_loss < 1e-13
        w, loss, grad = candidate, new_loss, new_grad
        if converged:
            break
    return w


def _fit_scipy(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    from scipy.optimize import minimize

    k = probs.shape[0]
    result = minimize(
        lambda w: _mixture_loss_and_grad(np.clip(w, 0, None), probs, labels),
        np.full(k, 1.0 / k),
        jac=True,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * k,
        constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1.0, "jac": lambda w: np.ones_like(w)}],
        options={"ftol": 1e-12, "maxiter": 500},
    )
    w = np.clip(result.x, 0.0, None)
    return w / w.sum()


def cross_fitted_mixture_loss(
    probs: np.ndarray, labels: np.ndarray, folds: int = 5, method: FitMethod = "auto"
) -> float:
    """The blend's log loss when each row's weights were fitted on the other folds (row i in fold
    i mod `folds`): what fitted weights are worth on rows they have not seen. The in-sample log
    loss of a fit is optimistic by about (members - 1) / (2 rows) nats, enough to make a useless
    member look like a gain on a ~200-battle eval split."""
    n = labels.shape[0]
    folds = max(2, min(folds, n))
    fold = np.arange(n) % folds
    mixed = np.empty_like(labels)
    for k in range(folds):
        held = fold == k
        w, _ = fit_mixture(probs[:, ~held], labels[~held], method)
        mixed[held] = np.tensordot(w, probs[:, held], axes=1)
    return log_loss(mixed, labels)


def fit_mixture(probs: np.ndarray, labels: np.ndarray, method: FitMethod) -> tuple[np.ndarray, str]:
    """(weights, the method used) for stacked `probs` [k, n, 3]."""
    if probs.shape[0] == 1:
        return np.ones(1), "one member"
    if method == "auto":
        try:
            import scipy.optimize  # noqa: F401

            method = "scipy"
        except ImportError:
            method = "eg"
    return (_fit_scipy(probs, labels) if method == "scipy" else _fit_eg(probs, labels)), method
