"""A new head starts at the training labels' prior (issue #12): `init_head_to_prior`."""

from __future__ import annotations

import numpy as np
import torch
from loguru import logger

from hpref.protocols import PreferenceModel
from hpref.train.data import Tokenized


def prior_logits(labels: np.ndarray, floor: float = 1e-4) -> torch.Tensor:
    """Log of the mean label distribution (each class at least `floor`), centred: the logits of a
    head that predicts the label prior whatever its input."""
    prior = np.clip(np.asarray(labels, dtype=np.float64).mean(axis=0), floor, None)
    logits = np.log(prior / prior.sum())
    return torch.tensor(logits - logits.mean(), dtype=torch.float32)


def init_head_to_prior(model: PreferenceModel, data: Tokenized) -> torch.Tensor | None:
    """Start a new head at the training labels' prior: its output bias = their log prior.

    On chosen/rejected data the tie class never occurs, and a zero bias makes the first steps
    spend themselves pushing P(tie) from 1/3 towards 0 (loss ln 3 -> ln 2) through the head's
    weights and the backbone before any A-vs-B signal is learnt (issue #12); on arena data the prior
    is nearly uniform and this changes little. A trained head (an export) is left alone. Collective:
    every rank holds the same labels and calls it."""
    if not model.fresh_head:
        return None
    labels = np.array([e.label for e in data.examples if e.label is not None], dtype=np.float64)
    if labels.size == 0:
        return None
    bias = prior_logits(labels)
    model.set_output_bias(bias)
    logger.info(f"head output bias set to the training labels' log prior {bias.tolist()}")
    return bias
