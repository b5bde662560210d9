"""Prediction files in the Kaggle LMSYS submission format: `id, winner_model_a, winner_model_b, winner_tie`.

Written as CSV, Parquet or JSON Lines, chosen by the file name (as the data readers do). Reading is
strict because a prediction file feeds scores, blends and soft labels, where a silently dropped,
duplicated or unnormalised row corrupts everything downstream: a missing or duplicate id, a missing
column, a NaN, a value outside [0, 1] or a row not summing to 1 (within 1e-3, the arena reader's
tolerance) is a `DataError` naming the file, the 1-based data row and the column.

Probabilities are written at full precision (shortest round-trip repr), not rounded: a blend of
rounded files, or soft labels from them, would no longer sum to one exactly.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpref.data.readers import LABEL_SUM_TOLERANCE
from hpref.data.records import LABELS
from hpref.data.tables import TableFile, detect_format
from hpref.errors import DataError
from hpref.runfolder.files import write_bytes_atomic

COLUMNS = ("id", *LABELS)


@dataclass
class Predictions:
    """Probabilities per battle id, in file order. `probs[i]` is (p_a, p_b, p_tie) of `ids[i]`."""

    ids: list[str]
    probs: np.ndarray
    source: str = "(in memory)"

    def __post_init__(self) -> None:
        self.probs = np.asarray(self.probs, dtype=np.float64)
        if self.probs.shape != (len(self.ids), 3):
            raise ValueError(f"{len(self.ids)} ids but probabilities of shape {self.probs.shape}")

    def __len__(self) -> int:
        return len(self.ids)

    def index(self) -> dict[str, int]:
        return {id_: i for i, id_ in enumerate(self.ids)}

    def reorder(self, ids: Sequence[str]) -> Predictions:
        """The same predictions in the order of `ids` (which must be exactly this file's ids)."""
        where = self.index()
        missing = next((i for i in ids if i not in where), None)
        if missing is not None or len(ids) != len(self.ids):
            raise DataError(f"{self.source}: ids differ from the requested order (first: {missing!r})")
        return Predictions(list(ids), self.probs[[where[i] for i in ids]], self.source)


def write_predictions(
    path: str | Path, ids: Sequence[str], probs: Any, fmt: str = "auto", *, unique_ids: bool = True
) -> Path:
    """Write a submission file (format by extension: .csv, .parquet, .jsonl), atomically.

    A repeated id is refused unless `unique_ids=False` (the trainer's eval, where a data set with
    repeated ids must not fail a finished run; `hpref data stats` reports them)."""
    import pandas as pd

    path = Path(path)
    kind = detect_format(path, fmt)  # type: ignore[arg-type]
    preds = Predictions([str(i) for i in ids], probs)
    if unique_ids and len(set(preds.ids)) != len(preds.ids):
        seen: set[str] = set()
        dup = next(i for i in preds.ids if i in seen or seen.add(i))  # type: ignore[func-returns-value]
        raise DataError(f"{path}: refusing to write duplicate id {dup!r}")
    frame = pd.DataFrame({"id": preds.ids, **{c: preds.probs[:, k] for k, c in enumerate(LABELS)}})
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "csv":
        data = frame.to_csv(index=False, float_format="%.17g").encode("utf-8")
    elif kind == "parquet":
        buffer = io.BytesIO()
        frame.to_parquet(buffer, index=False)
        data = buffer.getvalue()
    else:
        data = frame.to_json(orient="records", lines=True, double_precision=15).encode("utf-8")
    return write_bytes_atomic(path, data)


def _probability(value: Any, where: str, column: str) -> float:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{where}, column '{column}': missing value")
    if isinstance(value, bool):
        raise DataError(f"{where}, column '{column}': {value!r} is not a probability")
    try:
        p = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where}, column '{column}': {value!r} is not a number") from None
    if math.isnan(p):
        raise DataError(f"{where}, column '{column}': NaN")
    if not (0.0 <= p <= 1.0):
        raise DataError(f"{where}, column '{column}': {p!r} is outside [0, 1]")
    return p


def read_predictions(path: str | Path, fmt: str = "auto") -> Predictions:
    """Read a submission file back with the strict checks of the module docstring.

    Rows are renormalised to sum to exactly 1 after the tolerance check (they differ by rounding).
    """
    table = TableFile(path, fmt)  # type: ignore[arg-type]
    source = str(table.path)
    missing = [c for c in COLUMNS if c not in table.columns]
    if missing:
        raise DataError(
            f"{source}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"(a prediction file has {', '.join(COLUMNS)}; found: {', '.join(table.columns) or 'none'})"
        )
    ids: list[str] = []
    rows: list[tuple[float, float, float]] = []
    first_row: dict[str, int] = {}
    for number, row in table.rows():
        where = f"{source}: row {number}"
        if not isinstance(row, dict):  # a RowError from the JSONL reader
            raise DataError(f"{where}: {row}")
        raw_id = row.get("id")
        if raw_id is None or (isinstance(raw_id, float) and math.isnan(raw_id)) or not str(raw_id).strip():
            raise DataError(f"{where}, column 'id': missing id")
        id_ = str(raw_id).strip()
        if id_ in first_row:
            raise DataError(f"{where}, column 'id': duplicate id {id_!r} (first at row {first_row[id_]})")
        first_row[id_] = number
        probs = tuple(_probability(row.get(c), where, c) for c in LABELS)
        total = sum(probs)
        if abs(total - 1.0) > LABEL_SUM_TOLERANCE:
            raise DataError(
                f"{where}, columns {','.join(LABELS)}: probabilities sum to {total:.6g}, expected 1"
            )
        ids.append(id_)
        rows.append((probs[0] / total, probs[1] / total, probs[2] / total))  # type: ignore[arg-type]
    if not ids:
        raise DataError(f"{source}: no prediction rows")
    return Predictions(ids, np.array(rows, dtype=np.float64), source)
