"""K-fold selection grouped by prompt and stratified by label, computed while streaming.

Grouping matters because arena files repeat a prompt across many model pairs: a split that puts the
same prompt in train and eval measures memorisation. Stratifying keeps each fold's label shares
(A / B / tie) close to the file's, so a small eval fold is not accidentally tie-heavy.

The assignment is made in one pass, in file order, without holding the data: the first row of a new
prompt group decides the group's fold — the fold holding the fewest rows of that row's label class
(then the fewest rows overall), ties broken by a seeded hash of the prompt, so the result depends only
on the file, the seed and `folds`. Every later row of the group follows it. Train and eval built from
the same file and seed therefore see complementary folds, with no shared state between them.
The folds depend on the split seed, never on the run seed: the pairwise reader stratifies by its
coin-free label ("chosen wins"), since its A/B labels move with the run seed.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from hpref.data.records import Battle, Probs

#: Label classes used for stratification: 0 = A wins, 1 = B wins, 2 = tie, 3 = unlabeled.
UNLABELED = 3


def label_class(label: Probs | None) -> int:
    """The stratification class of a label: its argmax (soft labels too), or UNLABELED."""
    if label is None:
        return UNLABELED
    return max(range(3), key=lambda i: label[i])


def prompt_key(prompt: tuple[str, ...]) -> bytes:
    """A group key for a conversation's user turns, insensitive to case and whitespace runs, so
    near-identical copies of one prompt cannot straddle train and eval."""
    text = "\x1f".join(" ".join(turn.split()).lower() for turn in prompt)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()


class FoldAssigner:
    """Assigns each battle a fold in [0, folds) as battles stream by (see module docstring)."""

    def __init__(self, folds: int, seed: int) -> None:
        if folds < 1:
            raise ValueError(f"folds must be >= 1, got {folds}")
        self.folds = folds
        self.seed = seed
        self._group_fold: dict[bytes, int] = {}
        self._class_counts = [[0] * folds for _ in range(UNLABELED + 1)]
        self._totals = [0] * folds

    def fold_of(self, battle: Battle, stratum: Probs | None | Literal["label"] = "label") -> int:
        """The battle's fold. `stratum` is the label to stratify by, by default the battle's own; a
        reader whose labels depend on the run seed (the pairwise A/B coin) passes a seed-free one, so
        the folds do not move when the run seed does."""
        key = prompt_key(battle.prompt)
        cls = label_class(battle.label if stratum == "label" else stratum)
        fold = self._group_fold.get(key)
        if fold is None:
            counts = self._class_counts[cls]
            best = min((counts[f], self._totals[f]) for f in range(self.folds))
            candidates = [f for f in range(self.folds) if (counts[f], self._totals[f]) == best]
            tie_break = hashlib.blake2b(key, digest_size=8, key=str(self.seed).encode()).digest()
            fold = candidates[int.from_bytes(tie_break, "little") % len(candidates)]
            self._group_fold[key] = fold
        self._class_counts[cls][fold] += 1
        self._totals[fold] += 1
        return fold
