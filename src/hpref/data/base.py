"""What every dataset component shares: fold selection, error policy, the read summary.

A dataset component is built as `build(config, seed)` and returns a `BattleSource`: `battles()`
streams `Battle` records (never the whole file in memory), and after the stream is exhausted
`summary` says how many rows were read, used, skipped (with reasons) and left to the other split.
`fingerprint()` identifies the exact battles the source yields (data bytes + every setting that
changes them); the token cache keys on it.

Subclasses implement `_rows()` (raw rows with their 1-based row numbers, file order) and
`_parse(row)` (one raw row -> `Battle`, raising `RowError(column, reason)` for a bad row). The base
class turns a `RowError` into a `DataError` naming file, row and column (`on_error = "raise"`) or
counts it (`on_error = "skip"`): a row is never dropped without being counted.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, model_validator

from hpref.data.records import Battle, Probs
from hpref.data.splits import FoldAssigner, label_class
from hpref.errors import DataError


class RowError(Exception):
    """One bad row: which column and why. The reader adds the file and row number; `line` is the
    file line where that differs from the row (CSV cells may span lines), for the error message."""

    def __init__(self, column: str, reason: str, line: int | None = None) -> None:
        super().__init__(f"column '{column}': {reason}")
        self.column = column
        self.reason = reason
        self.line = line


class DatasetConfig(BaseModel):
    """Parameters every dataset component accepts."""

    model_config = ConfigDict(extra="forbid")

    on_error: Literal["raise", "skip"] = Field(
        "raise", description="a malformed row stops the run (raise) or is skipped and counted (skip)"
    )
    folds: int = Field(1, ge=1, description="number of folds (grouped by prompt, stratified by label)")
    fold: int = Field(0, ge=0, description="the held-out fold (0-based)")
    split: Literal["all", "train", "eval"] = Field(
        "all", description="all rows, every fold but `fold` (train), or only `fold` (eval)"
    )
    limit: int | None = Field(None, ge=1, description="read at most this many rows (before the split)")
    split_seed: int = Field(
        0, description="seed of the fold tie-breaks; not the run seed, so every run sees the same eval fold"
    )

    @model_validator(mode="after")
    def _check_fold(self) -> DatasetConfig:
        if self.fold >= self.folds:
            raise ValueError(f"fold must be below folds ({self.folds}), got {self.fold}")
        if self.split != "all" and self.folds < 2:
            raise ValueError(f"split = '{self.split}' needs folds >= 2")
        return self


@dataclass
class ReadSummary:
    """Counts for one pass over a source. `skipped` maps "column: reason" to a count and
    `skipped_rows` keeps the first few row numbers of each reason, for a message a user can act on."""

    source: str
    rows_read: int = 0
    rows_used: int = 0
    rows_skipped: int = 0
    rows_other_split: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_rows: dict[str, list[int]] = field(default_factory=dict)
    labels: Counter[str] = field(default_factory=Counter)
    complete: bool = False

    def skip(self, row: int, error: RowError) -> None:
        reason = f"{error.column}: {error.reason}"
        self.rows_skipped += 1
        self.skipped[reason] += 1
        examples = self.skipped_rows.setdefault(reason, [])
        if len(examples) < 3:
            examples.append(row)

    def count_label(self, label: Probs | None) -> None:
        if label is None:
            self.labels["unlabeled"] += 1
        elif max(label) < 1.0:
            self.labels["soft"] += 1
        else:
            self.labels[("a", "b", "tie")[label_class(label)]] += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "rows_read": self.rows_read,
            "rows_used": self.rows_used,
            "rows_skipped": self.rows_skipped,
            "rows_other_split": self.rows_other_split,
            "skipped": dict(self.skipped),
            "skipped_rows": dict(self.skipped_rows),
            "labels": dict(self.labels),
            "complete": self.complete,
        }

    def __str__(self) -> str:
        text = (
            f"{self.source}: {self.rows_read} rows read, {self.rows_used} used, "
            f"{self.rows_skipped} skipped, {self.rows_other_split} in other folds"
        )
        if self.skipped:
            reasons = "; ".join(
                f"{n} x {reason} (rows {', '.join(map(str, self.skipped_rows[reason]))}"
                f"{', ...' if n > len(self.skipped_rows[reason]) else ''})"
                for reason, n in self.skipped.most_common()
            )
            text += f" [{reasons}]"
        return text


def file_digest(path: Path) -> str:
    """blake2b of a file's bytes: the cache key must change when the data does, whatever its mtime."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class BattleSource:
    """Base of the built-in dataset components (see module docstring)."""

    def __init__(self, config: DatasetConfig, seed: int, source: str) -> None:
        self.config = config
        self.seed = seed
        self.source = source
        self.summary = ReadSummary(source=source)

    # -- for subclasses ---------------------------------------------------------------------------
    def _rows(self) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def _parse(self, row: Any) -> Battle:
        raise NotImplementedError

    def _stratum(self, battle: Battle) -> Probs | None:
        """The label the fold split stratifies by: the battle's own, unless it depends on the run
        seed (then the split would too, and runs with different seeds would evaluate on folds the
        others trained on)."""
        return battle.label

    def _data_identity(self) -> str:
        """What identifies the underlying data (a file digest, a generator's seed), plus the run seed
        where it changes the battles (the pairwise A/B coin)."""
        raise NotImplementedError

    # -- the component interface ------------------------------------------------------------------
    def battles(self) -> Iterator[Battle]:
        """Stream the selected battles; `summary` is complete (and logged) once this is exhausted."""
        for battle, _row in self.battles_with_rows():
            yield battle

    def battles_with_rows(self) -> Iterator[tuple[Battle, Any]]:
        """`battles()`, each with the raw row it was parsed from (a file row's columns: what a
        labelled RL reward reads beside the prompt, `hpref.data.prompts.PromptSet.row`)."""
        config = self.config
        summary = self.summary = ReadSummary(source=self.source)
        assigner = FoldAssigner(config.folds, config.split_seed) if config.folds > 1 else None
        for row_number, raw in self._rows():
            if config.limit is not None and summary.rows_read >= config.limit:
                break
            summary.rows_read += 1
            try:
                if isinstance(raw, RowError):
                    raise raw
                battle = self._parse(raw)
            except RowError as exc:
                if config.on_error == "raise":
                    line = f" (line {exc.line})" if exc.line is not None else ""
                    raise DataError(
                        f"{self.source}: row {row_number}{line}, column '{exc.column}': {exc.reason}"
                        ' (set on_error = "skip" to skip and count bad rows)'
                    ) from None
                summary.skip(row_number, exc)
                continue
            if assigner is not None:
                in_fold = assigner.fold_of(battle, self._stratum(battle)) == config.fold
                if in_fold != (config.split == "eval") and config.split != "all":
                    summary.rows_other_split += 1
                    continue
            summary.rows_used += 1
            summary.count_label(battle.label)
            yield battle, raw
        summary.complete = True
        logger.info(str(summary))

    def fingerprint(self) -> str:
        """Identity of the battle stream: data + every setting that changes what `battles()` yields."""
        settings = json.dumps(
            {"kind": type(self).__name__, "config": self.config.model_dump(mode="json")},
            sort_keys=True,
        )
        return hashlib.blake2b((self._data_identity() + "\0" + settings).encode(), digest_size=16).hexdigest()
