"""Ensembles of prediction files, blend weights fitted on labelled data, and soft-label files.

A blend is the weighted arithmetic mean of the members' probabilities (a mixture), not a geometric
mean: a mixture's log loss is convex in the weights, so the fitted weights are a global optimum,
and a member that is confidently wrong on a row cannot drive the blend's probability to zero.

Members must predict exactly the same ids. Rows are matched by id, never by position: two files
written in different orders blend correctly, and a file that lost or gained a row is an error naming
the first id that differs, instead of a blend that pairs the wrong battles.

Soft labels for distillation: `write_soft_labels` joins predictions with the battles they were made
for and writes an arena-schema file whose winner columns are the predictions. The `arena` reader
accepts any label distribution summing to 1, so `hpref train` on that file trains a student on the
teacher's probabilities with no special mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from loguru import logger

from hpref.data.records import Battle
from hpref.errors import DataError, UserError
from hpref.prediction.blend import FitMethod, cross_fitted_mixture_loss, fit_mixture
from hpref.prediction.files import Predictions
from hpref.prediction.metrics import log_loss


def check_same_ids(members: Sequence[Predictions]) -> None:
    """Raise a `DataError` naming the first id where a member differs from the first member."""
    if not members:
        raise UserError("an ensemble needs at least one prediction file")
    first = members[0]
    reference = set(first.ids)
    for other in members[1:]:
        theirs = set(other.ids)
        if theirs == reference:
            continue
        only_first = next((i for i in first.ids if i not in theirs), None)
        if only_first is not None:
            raise DataError(
                f"{other.source}: has no prediction for id {only_first!r}, which {first.source} has "
                f"({len(reference - theirs)} such ids, {len(theirs - reference)} the other way); "
                "ensemble members must predict exactly the same ids"
            )
        only_other = next(i for i in other.ids if i not in reference)
        raise DataError(
            f"{other.source}: predicts id {only_other!r}, which {first.source} does not "
            f"({len(theirs - reference)} such ids); ensemble members must predict exactly the same ids"
        )


def parse_weights(text: str | None, count: int) -> np.ndarray:
    """`"2,1"` -> [2/3, 1/3]; None -> equal weights. Non-negative, not all zero, one per member."""
    if text is None or not text.strip():
        return np.full(count, 1.0 / count)
    try:
        values = np.array([float(v) for v in text.split(",")], dtype=np.float64)
    except ValueError:
        raise UserError(f"--weights {text!r}: expected comma-separated numbers like 2,1") from None
    if len(values) != count:
        raise UserError(f"--weights {text!r}: {len(values)} weights for {count} prediction files")
    return normalise_weights(values)


def normalise_weights(weights: Iterable[float]) -> np.ndarray:
    w = np.asarray(list(weights), dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise UserError(f"weights must be non-negative and not all zero, got {w.tolist()}")
    return w / w.sum()


def stack(members: Sequence[Predictions]) -> tuple[list[str], np.ndarray]:
    """(ids in the first member's order, probabilities [k, n, 3]) after checking the ids."""
    check_same_ids(members)
    ids = members[0].ids
    return list(ids), np.stack([m.reorder(ids).probs for m in members])


def blend(members: Sequence[Predictions], weights: Iterable[float] | None = None) -> Predictions:
    """The weighted mean of the members' probabilities, rows matched by id."""
    ids, probs = stack(members)
    w = np.full(len(members), 1.0 / len(members)) if weights is None else normalise_weights(weights)
    if len(w) != len(members):
        raise UserError(f"{len(w)} weights for {len(members)} prediction files")
    mixed = np.tensordot(w, probs, axes=1)
    return Predictions(ids, mixed / mixed.sum(axis=1, keepdims=True), source="blend")


# --------------------------------------------------------------------------------------------------
# fitting weights (the numbers: hpref.prediction.blend)


def fit_weights(members: Sequence[Predictions], labels: np.ndarray, method: FitMethod = "auto") -> np.ndarray:
    """Blend weights minimising log loss on labelled rows (`labels[i]` belongs to `members[0].ids[i]`).

    "scipy" uses SLSQP on the simplex, "eg" exponentiated gradient in numpy, "auto" scipy when it is
    installed. Both find the same optimum (the problem is convex); fit on data the members were not
    trained on, or the weights reward over-fitting.
    """
    _, probs = stack(members)
    labels = np.asarray(labels, dtype=np.float64)
    if labels.shape != probs.shape[1:]:
        raise ValueError(f"labels {labels.shape} do not match the predictions {probs.shape[1:]}")
    w, method = fit_mixture(probs, labels, method)
    logger.info(
        f"fitted blend weights {np.round(w, 4).tolist()} ({method}): log loss "
        f"{log_loss(np.tensordot(w, probs, axes=1), labels):.5f}"
    )
    return w


def cross_fitted_log_loss(
    members: Sequence[Predictions], labels: np.ndarray, folds: int = 5, method: FitMethod = "auto"
) -> float:
    """The blend's log loss when each row's weights were fitted on the other folds
    (`hpref.prediction.blend.cross_fitted_mixture_loss`): what fitted weights are worth on rows they
    have not seen."""
    _, probs = stack(members)
    return cross_fitted_mixture_loss(probs, np.asarray(labels, dtype=np.float64), folds, method)


# --------------------------------------------------------------------------------------------------
# joining predictions with data


def read_battles(path: str | Path) -> list[Battle]:
    """Every battle of an arena-format file (labelled or not), ids checked for duplicates."""
    from hpref.data.readers import ArenaConfig, ArenaReader

    reader = ArenaReader(ArenaConfig(path=str(path)), seed=0)
    battles = list(reader.battles())
    seen: set[str] = set()
    for b in battles:
        if b.id in seen:
            raise DataError(f"{path}: duplicate id {b.id!r}; predictions are joined to battles by id")
        seen.add(b.id)
    return battles


def labels_for(
    preds: Predictions, battles: Sequence[Battle], *, source: str = "data"
) -> tuple[np.ndarray, np.ndarray | None]:
    """(labels [n, 3], truth [n, 3] or None) in `preds.ids` order.

    Every predicted id must be in the data and labelled; data rows without a prediction are allowed
    (predictions for one fold scored against the whole file) and counted in the log.
    """
    by_id = {b.id: b for b in battles}
    missing = next((i for i in preds.ids if i not in by_id), None)
    if missing is not None:
        raise DataError(f"{preds.source}: id {missing!r} is not in {source}")
    chosen = [by_id[i] for i in preds.ids]
    unlabelled = next((b.id for b in chosen if b.label is None), None)
    if unlabelled is not None:
        raise DataError(f"{source}: battle {unlabelled!r} has no label, so the predictions cannot be scored")
    extra = len(by_id) - len(chosen)
    if extra:
        logger.info(f"{source}: {extra} battles have no prediction and are not scored")
    labels = np.array([b.label for b in chosen], dtype=np.float64)
    truth = None
    if all(b.truth is not None for b in chosen):
        truth = np.array([b.truth for b in chosen], dtype=np.float64)
    return labels, truth


def soft_labelled(preds: Predictions, battles: Sequence[Battle], *, source: str = "data") -> list[Battle]:
    """The battles with their labels replaced by the predictions (every battle needs one)."""
    where = preds.index()
    missing = next((b.id for b in battles if b.id not in where), None)
    if missing is not None:
        raise DataError(f"{preds.source}: no prediction for battle {missing!r} of {source}")
    return [replace(b, label=tuple(float(x) for x in preds.probs[where[b.id]])) for b in battles]


def write_soft_labels(
    path: str | Path, preds: Predictions, battles: Sequence[Battle], source: str = "data"
) -> Path:
    """An arena-schema file (CSV/Parquet/JSONL by extension) whose winner columns are `preds`: train
    a student on it with the `arena` dataset as on any labelled file."""
    from hpref.data.readers import write_arena_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_arena_file(path, soft_labelled(preds, battles, source=source))
