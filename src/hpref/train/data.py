"""Battles -> tokenized examples for the trainer (both A/B views for training, one for eval).

Every rank holds the same examples, so the packing plan, a pure function of the lengths, agrees on
every rank without communication. Training data goes through the token cache (`hpref.data.cache`):
rank 0 tokenizes and writes it while the others wait at a barrier, then they load it. Eval data
is tokenized directly, keeping the battles, whose ids the predictions file needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hpref.data.cache import encode_views, tokenize_dataset
from hpref.data.packing import TokenizedExample
from hpref.data.records import Battle
from hpref.errors import DataError
from hpref.protocols import BattleSource, Formatter


@dataclass
class Tokenized:
    """Examples plus, for eval data, the battles they came from (`examples[i].row` indexes them)."""

    examples: list[TokenizedExample]
    battles: list[Battle] | None = None

    @property
    def lengths(self) -> list[int]:
        return [len(e) for e in self.examples]

    @property
    def num_battles(self) -> int:
        return len({e.row for e in self.examples})


def tokenize_cached(source: BattleSource, formatter: Formatter, *, swap: str, name: str) -> Tokenized:
    """Training examples through the token cache; rank 0 fills it first (collective when a process
    group is up)."""
    import torch.distributed as dist

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    examples: list[TokenizedExample] = []
    if not distributed or dist.get_rank() == 0:
        examples = tokenize_dataset(source, formatter, swap=swap)
    if distributed:
        dist.barrier()
        if dist.get_rank() != 0:
            examples = tokenize_dataset(source, formatter, swap=swap)
    if not examples:
        raise DataError(f"{name}: the dataset yielded no battles")
    return Tokenized(examples=examples)


def tokenize(battles: Iterable[Battle], formatter: Formatter, *, both_views: bool, name: str) -> Tokenized:
    """Encode each battle (and, with `both_views`, its swapped copy) with the formatter, keeping the
    battles (`hpref.data.cache.encode_views`, uncached)."""
    kept = list(battles)
    if not kept:
        raise DataError(f"{name}: the dataset yielded no battles")
    return Tokenized(examples=encode_views(kept, formatter, both_views=both_views).examples(), battles=kept)


def require_labels(data: Tokenized, name: str) -> None:
    missing = sum(e.label is None for e in data.examples)
    if missing:
        raise DataError(f"{name}: {missing} battles have no label; training and eval data must be labelled")
