"""Built-in dataset components: `arena`, `pairwise` and `synthetic-arena`.

Each `build(config, seed)` returns a `hpref.data.base.BattleSource`: `battles()` streams `Battle`
records, `summary` counts rows read / used / skipped (with reasons) once the stream is exhausted, and
`fingerprint()` keys the token cache. All three share the fold selection and `on_error` policy of
`hpref.data.base.DatasetConfig`.
"""

from __future__ import annotations

from hpref.arena.source import SyntheticArena, SyntheticArenaConfig
from hpref.data.readers import ArenaConfig, ArenaReader, PairwiseConfig, PairwiseReader
from hpref.hookspecs import hookimpl


def build_arena(config: ArenaConfig, seed: int) -> ArenaReader:
    """Chatbot-Arena / Kaggle LMSYS battles from a CSV, Parquet or JSONL file."""
    return ArenaReader(config, seed)


def build_pairwise(config: PairwiseConfig, seed: int) -> PairwiseReader:
    """Chosen/rejected pairs (HH-RLHF transcripts, TRL message lists) as two-way battles."""
    return PairwiseReader(config, seed)


def build_synthetic_arena(config: SyntheticArenaConfig, seed: int) -> SyntheticArena:
    """Generated battles with known outcome probabilities (the Bayes floor is computable)."""
    return SyntheticArena(config, seed)


@hookimpl
def register_datasets(register):
    register(name="arena", config=ArenaConfig, build=build_arena)
    register(name="pairwise", config=PairwiseConfig, build=build_pairwise)
    register(name="synthetic-arena", config=SyntheticArenaConfig, build=build_synthetic_arena)
