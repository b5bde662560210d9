"""Padding-free packed micro-batches and the plan of which sequences each rank runs in each step.

Data flow: tokenized examples -> `plan_steps` (train) / `plan_eval` (eval) -> per rank and step, a
list of micro-batches (tuples of example indices) -> `collate` -> `PackedBatch` -> the model.

Why the plan has the shape it has
- A step is `batch_size` battles over all ranks. With swap = "full" a battle's two views (A/B and
  B/A) are one group and always land in the same step, so every update sees both orders.
- The step's sequences are spread over ranks longest first, each to the rank with the fewest tokens
  so far (ranks end within about one sequence of each other), then each rank packs its share into
  micro-batches of at most `micro_batch_tokens` tokens (best-fit decreasing: bins are full and
  similar lengths share a bin); a sequence longer than the budget is a micro-batch of its own.
- EVERY RANK RUNS THE SAME NUMBER OF MICRO-BATCHES in a step, or FSDP's collectives hang: a rank with
  fewer micro-batches than the busiest splits its fullest multi-sequence micro-batch in two until the
  counts match, and, when nothing is left to split, adds filler micro-batches (one 1-token sequence,
  row -1, weight 0).
- `StepPlan.num_sequences` is the step's global count of real sequences. Weight each micro-batch's
  loss as `sum(weights * loss_per_sequence) / step.num_sequences`; summed over a rank's micro-batches
  and *summed* over ranks (or averaged and multiplied by world_size, as FSDP averages gradients) this
  is the mean loss over the step's sequences, whatever the micro-batch sizes.
- Everything is a pure function of (lengths, rows, settings, seed, epoch): every rank computes the
  same plan locally, and resuming mid-epoch is skipping the completed steps (`StepSampler`).

Paired examples (a reward model's battle: A's conversation and B's, `TokenizedExample.split`) are
planned as one unit of their total length, so both sequences of a battle are always in the same
micro-batch, next to each other; `collate` gives each its own boundary in `cu_seqlens`.

`plan_eval` packs every example exactly once (no swap selection, no shuffling) with the same
equal-count rule; gathered predictions drop rows == -1 (fillers).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from hpref.data.records import Probs

FILLER = -1  # the example index / row of a filler sequence
Swap = Literal["none", "full", "random"]


@dataclass
class TokenizedExample:
    """One formatted view of one battle. `row` is the battle's index in its dataset's `battles()`
    order; `swapped` says this is the B/A view (its label already swapped). `split` > 0 makes it two
    sequences, ids[:split] (A's) and ids[split:] (B's), for a reward model that scores each alone;
    0 is one sequence (a judge's)."""

    ids: np.ndarray | list[int]
    label: Probs | None
    row: int
    swapped: bool = False
    split: int = 0

    def __len__(self) -> int:
        return len(self.ids)


def filler(token_id: int = 0, *, paired: bool = False) -> TokenizedExample:
    """The zero-weight dummy that keeps micro-batch counts equal across ranks: one 1-token sequence,
    or a pair of them when the data is paired (a reward model reads sequences two by two)."""
    if paired:
        return TokenizedExample(ids=np.array([token_id] * 2, dtype=np.int32), label=None, row=FILLER, split=1)
    return TokenizedExample(ids=np.array([token_id], dtype=np.int32), label=None, row=FILLER, swapped=False)


@dataclass
class PackedBatch:
    """One micro-batch: n examples concatenated into one row of T tokens, no padding.

    An example is s = 1 sequence (a judge's) or s = 2 (a reward model's A and B, consecutive), the
    same s for every example of a batch. Per sequence (m = s n): position_ids [T] long (restarting
    at 0 per sequence), cu_seqlens [m+1] int32 (starts at 0, flash-attention's varlen layout),
    last_token_index [m] long, max_seqlen (python int). Per example, which is what the model
    returns one row of logits for: labels [n, 3] float (zeros when unlabeled; see has_label), rows
    [n] long (-1 for fillers), swapped [n] bool, weights [n] float (1 real, 0 filler).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    last_token_index: torch.Tensor
    labels: torch.Tensor
    has_label: torch.Tensor
    rows: torch.Tensor
    swapped: torch.Tensor
    weights: torch.Tensor
    max_seqlen: int

    @property
    def num_sequences(self) -> int:
        """All examples, fillers included (the model returns one output per example)."""
        return int(self.rows.numel())

    @property
    def num_real_sequences(self) -> int:
        return int((self.rows >= 0).sum())

    @property
    def sequences_per_example(self) -> int:
        return (self.cu_seqlens.numel() - 1) // max(self.rows.numel(), 1)

    @property
    def num_tokens(self) -> int:
        """Real tokens (fillers excluded): the numerator of tokens/s."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        per_example = lengths.reshape(self.rows.numel(), -1).sum(dim=1)
        return int(per_example[self.rows >= 0].sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        moved = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in (
                "input_ids",
                "position_ids",
                "cu_seqlens",
                "last_token_index",
                "labels",
                "has_label",
                "rows",
                "swapped",
                "weights",
            )
        }
        return PackedBatch(**moved, max_seqlen=self.max_seqlen)


def collate(examples: Sequence[TokenizedExample]) -> PackedBatch:
    """Concatenate examples into one padding-free `PackedBatch` (rows < 0 get weight 0); a paired
    example (split > 0) is two sequences, each with its own boundary and positions from 0."""
    if not examples:
        raise ValueError("collate needs at least one example")
    paired = {e.split > 0 for e in examples}
    if len(paired) > 1:
        raise ValueError(
            "collate got paired (split > 0) and single-sequence examples in one batch: a model reads "
            "either one sequence or two per example"
        )
    if paired.pop():
        lengths = [n for e in examples for n in (e.split, len(e) - e.split)]
    else:
        lengths = [len(e) for e in examples]
    if min(lengths) < 1:
        raise ValueError("collate got an empty sequence")
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in examples])
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    positions = np.arange(len(ids), dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lengths)
    labels = np.array(
        [e.label if e.label is not None else (0.0, 0.0, 0.0) for e in examples], dtype=np.float32
    )
    rows = np.array([e.row for e in examples], dtype=np.int64)
    return PackedBatch(
        input_ids=torch.from_numpy(ids),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=torch.from_numpy(cu),
        last_token_index=torch.from_numpy(cu[1:].astype(np.int64) - 1),
        labels=torch.from_numpy(labels),
        has_label=torch.tensor([e.label is not None for e in examples], dtype=torch.bool),
        rows=torch.from_numpy(rows),
        swapped=torch.tensor([e.swapped for e in examples], dtype=torch.bool),
        weights=torch.from_numpy((rows >= 0).astype(np.float32)),
        max_seqlen=max(lengths),
    )


# --------------------------------------------------------------------------------------------------
# planning


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: `micro_batches[rank][k]` is a tuple of example indices (FILLER = -1), the
    same number of micro-batches on every rank."""

    index: int
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    num_sequences: int  # real sequences over all ranks: the loss denominator
    num_tokens: int  # real tokens over all ranks

    def for_rank(self, rank: int) -> tuple[tuple[int, ...], ...]:
        return self.micro_batches[rank]

    @property
    def num_micro_batches(self) -> int:
        """Per rank (equal on all ranks)."""
        return len(self.micro_batches[0])

    def batches(
        self, rank: int, examples: Sequence[TokenizedExample], filler_token_id: int = 0
    ) -> list[PackedBatch]:
        """This rank's micro-batches, collated (fillers shaped like the examples: paired or not)."""
        pad = filler(filler_token_id, paired=bool(examples) and examples[0].split > 0)
        return [collate([examples[i] if i >= 0 else pad for i in mb]) for mb in self.for_rank(rank)]


def _pack(indices: list[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Best-fit decreasing into bins of at most `budget` tokens (an oversized sequence alone).

    Longest first, each into the bin whose remaining room fits it most tightly (a sorted list of
    (room, bin) pairs, so packing a whole eval set of 10^5 sequences stays O(n log n)-ish)."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (remaining tokens, bin id), sorted
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(rooms, (n, -1))
        if k < len(rooms):
            room, b = rooms.pop(k)
            bins[b].append(i)
            bisect.insort(rooms, (room - n, b))
        else:
            bins.append([i])
            if budget - n > 0:
                bisect.insort(rooms, (budget - n, len(bins) - 1))
    return bins


def _split_fullest(bins: list[list[int]], lengths: Sequence[int]) -> bool:
    """Split the micro-batch with the most tokens among those holding 2+ sequences into two halves
    of similar token counts; False when every micro-batch is a single sequence."""
    load = lambda mb: sum(lengths[i] for i in mb)  # noqa: E731
    splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
    if not splittable:
        return False
    b = max(splittable, key=lambda b: (load(bins[b]), -b))
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(bins[b], key=lambda i: (-lengths[i], i)):
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(i)
        loads[side] += lengths[i]
    bins[b : b + 1] = list(halves)
    return True


def _distribute(indices: list[int], lengths: Sequence[int], world_size: int, budget: int):
    """Spread sequences over ranks, pack each rank's share, equalise micro-batch counts."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    totals = [0] * world_size
    # Longest first to the least-loaded rank (LPT): ranks end within one sequence of each other.
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (totals[r], len(shares[r]), r))
        shares[r].append(i)
        totals[r] += lengths[i]
    per_rank = [_pack(share, lengths, budget) for share in shares]
    target = max(1, max(len(bins) for bins in per_rank))
    for bins in per_rank:
        while len(bins) < target:
            if not _split_fullest(bins, lengths):
                bins.append([FILLER])
    return tuple(tuple(tuple(mb) for mb in bins) for bins in per_rank)


def spread_and_pack(
    lengths: Sequence[int], world_size: int, budget: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Items of `lengths` tokens spread over `world_size` ranks and packed into micro-batches of at
    most `budget` tokens, every rank the same number of them (`FILLER` where nothing is left to
    split): the step planner's rule (module docstring) for a caller with its own units (the RL
    trainer's prompt groups, `hpref.rl.trainer.batches`). Per rank, its micro-batches' item indices."""
    return _distribute(list(range(len(lengths))), lengths, world_size, budget)


def _groups(
    rows: Sequence[int], swapped: Sequence[bool], swap: Swap, rng: np.random.Generator
) -> list[list[int]]:
    """Example indices per battle, in first-seen order, after the swap selection."""
    by_row: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        by_row.setdefault(row, []).append(i)
    groups = []
    for members in by_row.values():
        if swap == "none":
            members = [i for i in members if not swapped[i]] or members[:1]
        elif swap == "random":
            members = [members[int(rng.integers(len(members)))]]
        groups.append(members)
    return groups


def plan_steps(
    lengths: Sequence[int],
    rows: Sequence[int],
    swapped: Sequence[bool],
    *,
    batch_size: int,
    world_size: int,
    micro_batch_tokens: int,
    seed: int,
    epoch: int,
    swap: Swap = "full",
    drop_last: bool = False,
) -> list[StepPlan]:
    """Every optimizer step of one epoch, for every rank (see the module docstring).

    lengths / rows / swapped describe the examples (index i = examples[i]); views of one battle share
    a row. swap: "full" keeps every view of a battle, in one step; "random" picks one view per battle
    per epoch; "none" keeps the unswapped view. batch_size counts battles (groups), so with "full" a
    step holds 2 x batch_size sequences. The last, smaller step is kept unless drop_last.
    """
    if not len(lengths) == len(rows) == len(swapped):
        raise ValueError("lengths, rows and swapped must have one entry per example")
    if batch_size < 1 or world_size < 1 or micro_batch_tokens < 1:
        raise ValueError("batch_size, world_size and micro_batch_tokens must be positive")
    rng = np.random.default_rng([seed, epoch])
    groups = _groups(rows, swapped, swap, rng)
    order = rng.permutation(len(groups))
    plans = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        if drop_last and len(chunk) < batch_size:
            break
        indices = [i for g in chunk for i in groups[g]]
        plans.append(
            StepPlan(
                index=len(plans),
                micro_batches=_distribute(indices, lengths, world_size, micro_batch_tokens),
                num_sequences=len(indices),
                num_tokens=sum(lengths[i] for i in indices),
            )
        )
    return plans


def plan_eval(lengths: Sequence[int], *, world_size: int, micro_batch_tokens: int) -> StepPlan:
    """Every example exactly once over all ranks, the same micro-batch count per rank; fillers have
    index -1 (their collated row is -1, so gathered predictions can drop them)."""
    indices = list(range(len(lengths)))
    return StepPlan(
        index=0,
        micro_batches=_distribute(indices, lengths, world_size, micro_batch_tokens),
        num_sequences=len(indices),
        num_tokens=int(sum(lengths)),
    )


@dataclass
class StepSampler:
    """The training plan with a resumable position: `state_dict()` after a completed step, and
    `load_state_dict()` on restart, continue with the next step of the same epoch. The state carries a
    fingerprint of the examples and settings, so resuming on different data fails loudly."""

    lengths: Sequence[int]
    rows: Sequence[int]
    swapped: Sequence[bool]
    batch_size: int
    world_size: int
    micro_batch_tokens: int
    seed: int
    swap: Swap = "full"
    drop_last: bool = False
    epoch: int = 0
    step: int = 0  # the next step to run in `epoch`
    _cache: dict[int, list[StepPlan]] = field(default_factory=dict, repr=False)

    def plans(self, epoch: int) -> list[StepPlan]:
        if epoch not in self._cache:
            self._cache = {
                epoch: plan_steps(
                    self.lengths,
                    self.rows,
                    self.swapped,
                    batch_size=self.batch_size,
                    world_size=self.world_size,
                    micro_batch_tokens=self.micro_batch_tokens,
                    seed=self.seed,
                    epoch=epoch,
                    swap=self.swap,
                    drop_last=self.drop_last,
                )
            }
        return self._cache[epoch]

    def steps_per_epoch(self) -> int:
        return len(self.plans(0))

    def __iter__(self):
        """The remaining steps of the current epoch; the position advances as each is taken (so a
        state saved after finishing step k resumes at k + 1), then moves to the next epoch."""
        plans = self.plans(self.epoch)
        while self.step < len(plans):
            plan = plans[self.step]
            self.step += 1
            yield plan
        self.epoch += 1
        self.step = 0

    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray(self.lengths, dtype=np.int64).tobytes())
        h.update(np.asarray(self.rows, dtype=np.int64).tobytes())
        h.update(np.asarray(self.swapped, dtype=np.bool_).tobytes())
        settings = [
            self.batch_size,
            self.world_size,
            self.micro_batch_tokens,
            self.seed,
            self.swap,
            self.drop_last,
        ]
        h.update(json.dumps(settings).encode())
        return h.hexdigest()

    def state_dict(self) -> dict[str, int | str]:
        return {"epoch": self.epoch, "step": self.step, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        if state.get("fingerprint") != self.fingerprint():
            raise ValueError(
                "sampler state was saved for different data or batching settings (lengths, rows, batch_size, "
                "world_size, micro_batch_tokens, seed or swap changed); cannot resume mid-epoch"
            )
        self.epoch = int(state["epoch"])
        self.step = int(state["step"])
