"""What a packed row is, as the attention paths read it: one row of `T` tokens holding sequences back
to back (`cu_seqlens`), and which keys each query may see there.

  VarlenContext   built once per forward, read by every attention layer (`hpref.models.attention`):
                  the boundaries, the segment ids, cached block masks, and per sequence where it is
                  not plainly causal (a `PrefixTree`, or a boolean mask)
  PrefixTree      one sequence that is a prefix and its branches (the RL trainer's prompt groups: a
                  prompt, then answers that each see it and themselves)
  GatheredKeys    the same row as a GPU varlen kernel takes it, each piece's keys gathered
  block_diagonal_mask / segment_ids_from_cu_seqlens: the masks of the masked SDPA path
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class VarlenContext:
    """What every attention layer of one forward pass needs to know about the packing.

    Built once per forward (not per layer): the Python list of boundaries and the segment ids are
    derived once, and block masks are cached per (causal, window) so a 24-layer model builds at most
    two of them.
    """

    backend: str
    cu_seqlens: torch.Tensor  # int32 [n + 1] on the compute device
    max_seqlen: int
    #: CPU bf16: attend in fp32 in every forward, not only in one autograd will differentiate
    #: (`upcast_for_backward`), so a forward without gradient computes exactly what a training
    #: forward does (DPO's reference and its policy, `hpref.models.pair_logprobs`)
    fp32_attention: bool = False
    #: per sequence, where it is not plainly causal: a `PrefixTree` (the RL trainer's prompt groups,
    #: each answer seeing its prompt and itself) or a boolean `[L, L]` mask (True: may attend); None
    #: for a causal one. Trees and causal sequences run on every backend (the GPU kernels on
    #: `GatheredKeys`); a boolean mask only on `sdpa_segments` (no varlen kernel takes a mask)
    segment_masks: list[PrefixTree | torch.Tensor | None] | None = None
    _boundaries: list[int] | None = None
    _segment_ids: torch.Tensor | None = None
    _masks: dict[tuple[bool, int | None], torch.Tensor] = field(default_factory=dict)
    _gathered: GatheredKeys | None = None

    @property
    def boundaries(self) -> list[int]:
        if self._boundaries is None:
            self._boundaries = [int(x) for x in self.cu_seqlens.tolist()]  # one host sync per forward
        return self._boundaries

    @property
    def total_tokens(self) -> int:
        return self.boundaries[-1]

    def segment_ids(self) -> torch.Tensor:
        if self._segment_ids is None:
            self._segment_ids = segment_ids_from_cu_seqlens(self.cu_seqlens, self.total_tokens)
        return self._segment_ids

    def block_mask(self, causal: bool, window: int | None) -> torch.Tensor:
        """Boolean `[T, T]` mask, True where query row may attend to key column."""
        key = (causal, window)
        if key not in self._masks:
            self._masks[key] = block_diagonal_mask(self.segment_ids(), causal=causal, window=window)
        return self._masks[key]

    def trees_only(self) -> bool:
        """Whether every sequence is causal or a `PrefixTree`: what a varlen kernel can attend
        (`GatheredKeys`); a boolean mask needs `sdpa_segments`."""
        masks = self.segment_masks or []
        return all(m is None or isinstance(m, PrefixTree) for m in masks)

    def gathered_keys(self) -> GatheredKeys:
        """The varlen kernels' layout of this row (`GatheredKeys`), built once per forward."""
        if self._gathered is None:
            self._gathered = GatheredKeys.of(self)
        return self._gathered


@dataclass(frozen=True)
class PrefixTree:
    """One packed sequence that is a prefix and its branches (a prompt, then each answer, which sees
    the prompt and, causally, itself: `hpref.models.pair_logprobs.pack_prefix_groups`).
    `sdpa_segments` attends it piece by piece, each query against the keys it may see: the prefix
    causally, then each branch against the prefix and its own tokens (`branch_masks`). Masking the
    whole `[L, L]` square instead computes every branch against every other branch's keys too, to
    throw them away: for a GRPO group of a 200-token prompt and four 64-token answers, ~2x the
    attention's work and memory."""

    prefix: int
    branches: tuple[int, ...]
    #: per branch, `[b, prefix + b]`: True over the prefix, causal over the branch itself
    branch_masks: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, prefix: int, branches: Sequence[int], device: torch.device | None = None) -> PrefixTree:
        masks = tuple(
            torch.cat(
                [
                    torch.ones(b, prefix, dtype=torch.bool, device=device),
                    torch.ones(b, b, dtype=torch.bool, device=device).tril(),
                ],
                dim=1,
            )
            for b in branches
        )
        return cls(prefix, tuple(branches), masks)

    def full_mask(self) -> torch.Tensor:
        """The same rule as one boolean `[L, L]` mask (True: the query row may attend to the key
        column): causal, and a branch's token sees the prefix and its own branch only."""
        device = self.branch_masks[0].device if self.branch_masks else None
        owner = torch.tensor(
            [-1] * self.prefix + [b for b, n in enumerate(self.branches) for _ in range(n)], device=device
        )
        causal = torch.ones(owner.numel(), owner.numel(), dtype=torch.bool, device=device).tril()
        return causal & ((owner[:, None] == owner[None, :]) | (owner[None, :] == -1))


@dataclass(frozen=True)
class GatheredKeys:
    """A row with `PrefixTree` sequences as a varlen kernel takes it: the queries in their packed
    order, cut into pieces (a tree's prefix, then each branch; a plain sequence whole), and each
    piece's keys gathered one piece after another (`index`, into the row's tokens): the prefix's
    own, a branch's prefix and then itself. flash-attn and torch's varlen kernel align the causal
    mask to the bottom right where a piece has more keys than queries, so a branch's i-th token sees
    the prefix and its own first i + 1 tokens: the tree's rule in one kernel call per layer, not a
    call per branch. A gathered key's place in its piece is its position in the sequence (a branch's
    keys are the prefix, then the branch), so a sliding window keeps its meaning too. The cost is
    the prefix's keys and values once more per branch (their gradient summed back by
    `index_select`'s backward)."""

    cu_q: torch.Tensor  # int32 [pieces + 1]
    cu_k: torch.Tensor  # int32 [pieces + 1]
    max_q: int
    max_k: int
    index: torch.Tensor  # long [sum of the pieces' key lengths]

    @classmethod
    def of(cls, ctx: VarlenContext) -> GatheredKeys:
        bounds = ctx.boundaries
        owners = ctx.segment_masks or [None] * (len(bounds) - 1)
        q_lengths: list[int] = []
        k_lengths: list[int] = []
        ranges: list[tuple[int, int]] = []  # the key index, as (start, end) runs
        for start, end, own in zip(bounds[:-1], bounds[1:], owners, strict=True):
            if not isinstance(own, PrefixTree):  # causal: its own keys
                q_lengths.append(end - start)
                k_lengths.append(end - start)
                ranges.append((start, end))
                continue
            prefix = (start, start + own.prefix)
            pieces, at = [(own.prefix, [prefix])], prefix[1]
            for branch in own.branches:
                pieces.append((branch, [prefix, (at, at + branch)]))
                at += branch
            for queries, runs in pieces:
                if queries:  # an empty piece has nothing to attend (a kernel need not see it)
                    q_lengths.append(queries)
                    k_lengths.append(sum(b - a for a, b in runs))
                    ranges.extend(runs)
        device = ctx.cu_seqlens.device  # built on the host, then one copy each to the GPU
        index = torch.cat([torch.arange(a, b) for a, b in ranges])
        cumulative = lambda lengths: torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)  # noqa: E731
        return cls(
            cu_q=cumulative(q_lengths).to(device),
            cu_k=cumulative(k_lengths).to(device),
            max_q=max(q_lengths),
            max_k=max(k_lengths),
            index=index.to(device),
        )


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """`[0,0,0,1,1,2,...]`: which packed sequence each of the `total` tokens belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(ids, lengths, output_size=total)


def block_diagonal_mask(
    segment_ids: torch.Tensor, *, causal: bool, window: int | None = None
) -> torch.Tensor:
    """Block-diagonal boolean mask over one packed row, optionally causal and/or windowed.

    `window` follows transformers' sliding-window convention: a query at i sees keys j with
    `i - j < window` (and, non-causal, `|i - j| < window`).
    """
    mask = segment_ids[:, None] == segment_ids[None, :]
    if causal or window is not None:
        pos = torch.arange(segment_ids.numel(), device=segment_ids.device)
        offset = pos[:, None] - pos[None, :]  # query index minus key index
        if causal:
            mask &= offset >= 0
        if window is not None:
            mask &= offset.abs() < window
    return mask


def window_mask(length: int, *, causal: bool, window: int, device: torch.device) -> torch.Tensor:
    return block_diagonal_mask(
        torch.zeros(length, dtype=torch.long, device=device), causal=causal, window=window
    )
