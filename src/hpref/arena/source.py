"""The `synthetic-arena` dataset: the synthetic arena's battles as a source (`hpref.arena` is the
world that makes them: tasks, the judge, the answer simulator, the report).

The battles are generated, not read: battle i depends only on (seed, i), every one carries its true
outcome distribution (`Battle.truth`), and `report()` gives the split's Bayes floor and cheap
baselines (`hpref.arena.arena_report`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from hpref.arena import FAMILIES, GENERATOR_VERSION, generate_battles
from hpref.data.base import BattleSource, DatasetConfig
from hpref.data.records import Battle

if TYPE_CHECKING:
    from hpref.arena.report import SyntheticReport


class SyntheticArenaConfig(DatasetConfig):
    num_battles: int = Field(4000, ge=1, description="battles generated (before the fold split)")
    seed: int | None = Field(None, description="generator seed; default: the run seed")
    max_turns: int = Field(3, ge=1, le=3, description="most user turns per conversation")
    labels: Literal["drawn", "soft"] = Field(
        "drawn", description="drawn = one-hot outcome drawn from the truth; soft = the true probabilities"
    )
    families: list[str] | None = Field(
        None, description=f"task families (default all: {', '.join(FAMILIES)})"
    )

    @field_validator("families")
    @classmethod
    def _known_families(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            unknown = [f for f in value if f not in FAMILIES]
            if unknown or not value:
                raise ValueError(f"unknown task families {unknown}; known: {', '.join(FAMILIES)}")
        return value


class SyntheticArena(BattleSource):
    """The `synthetic-arena` component: generated battles, with `report()` for floor and baselines."""

    def __init__(self, config: SyntheticArenaConfig, seed: int) -> None:
        self.data_seed = config.seed if config.seed is not None else seed
        super().__init__(config, seed, f"synthetic-arena(seed={self.data_seed}, n={config.num_battles})")

    def _all(self) -> Iterator[Battle]:
        c = self.config
        return generate_battles(
            c.num_battles, self.data_seed, max_turns=c.max_turns, labels=c.labels, families=c.families
        )

    def _rows(self):
        return enumerate(self._all(), start=1)

    def _parse(self, row: Battle) -> Battle:
        return row

    def _data_identity(self) -> str:
        return f"synthetic-arena:v{GENERATOR_VERSION}:seed={self.data_seed}"

    def report(self, folds: int | None = None, fold: int | None = None) -> SyntheticReport:
        """Floor and baselines: baselines fitted on the train folds, everything scored on the eval
        fold (the configured `folds`/`fold`, or 5 folds / fold 0 when the config does not split)."""
        from hpref.arena import arena_report  # the report imports torch (see hpref.arena)

        return arena_report(*self._report_split(folds, fold))

    def skill_ceilings(self, folds: int | None = None, fold: int | None = None) -> dict[str, float]:
        """`skill_ceilings` on the eval fold `report` scores."""
        from hpref.arena import skill_ceilings

        return skill_ceilings(self._report_split(folds, fold)[1])

    def _report_split(self, folds: int | None, fold: int | None) -> tuple[list[Battle], list[Battle]]:
        """(train, eval) battles of the fold `report` and `skill_ceilings` score on."""
        from hpref.data.splits import FoldAssigner

        c = self.config
        k = folds or (c.folds if c.folds > 1 else 5)
        held_out = fold if fold is not None else (c.fold if c.folds > 1 else 0)
        assigner = FoldAssigner(k, c.split_seed)
        train, evaluation = [], []
        for battle in self._all():
            (evaluation if assigner.fold_of(battle) == held_out else train).append(battle)
        return train, evaluation
