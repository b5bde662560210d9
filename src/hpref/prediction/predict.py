"""The one way to score a model: tokenized views in, probabilities per battle row out.

Flow: views (`hpref.data.cache.encode_views`: each battle, and with swap TTA its B/A copy) -> the
eval planner's packed micro-batches, longest first, under a token budget, every view on exactly one
rank -> softmax of the model's logits (float32) without autograd -> (row, swapped, probabilities)
all-gathered over the ranks when a process group is up -> swapped views mapped back and averaged
per row. Every rank returns the full result.

Swap test-time augmentation is this same call on both views of each battle. A judge trained without
(enough) swap augmentation learns where an answer sits, not only what it says; averaging both
orders cancels any such position effect exactly in the A-vs-B direction. The mapping back: a
swapped view's (p_a, p_b, p_tie) are the probabilities that the answer shown first (the original
B), the one shown second (the original A), or neither wins, so in the original's terms they are
(p_b, p_a, p_tie) (`unswap`). The average is arithmetic (a mixture), so the result is a distribution
and inherits the views' calibration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hpref.data.packing import PackedBatch, TokenizedExample, plan_eval
from hpref.protocols import DataParallelSplit, PreferenceModel


@dataclass
class Prediction:
    """Probabilities per row (`probs[i]` = (p_a, p_b, p_tie) of row i), and what scoring them took."""

    probs: np.ndarray  # [n_rows, 3] float64
    sequences: int  # views scored over all ranks, fillers excluded
    tokens: int  # real tokens scored over all ranks
    world_size: int = 1


def unswap(probs: Any) -> np.ndarray:
    """Probabilities of a swapped view in the original battle's terms: (p_b, p_a, p_tie)."""
    p = np.asarray(probs, dtype=np.float64)
    return p[..., [1, 0, 2]]


def combine_views(rows: Sequence[int], swapped: Sequence[bool], probs: Any, n_rows: int) -> np.ndarray:
    """Average the views of each row after mapping swapped views back; [n_rows, 3].

    Fillers (row < 0) are dropped. Raises when a row has no view: a lost battle must never become
    a silent uniform prediction.
    """
    p = np.asarray(probs, dtype=np.float64).reshape(-1, 3)
    rows_arr = np.asarray(rows, dtype=np.int64)
    flags = np.asarray(swapped, dtype=bool)
    if not (len(rows_arr) == len(flags) == len(p)):
        raise ValueError("rows, swapped and probs must have one entry per view")
    keep = rows_arr >= 0
    rows_arr, flags, p = rows_arr[keep], flags[keep], p[keep]
    oriented = np.where(flags[:, None], unswap(p), p)
    sums = np.zeros((n_rows, 3))
    counts = np.zeros(n_rows)
    np.add.at(sums, rows_arr, oriented)
    np.add.at(counts, rows_arr, 1.0)
    if np.any(counts == 0):
        lost = np.flatnonzero(counts == 0)
        raise RuntimeError(f"{len(lost)} battles have no scored view (first rows: {lost[:5].tolist()})")
    return sums / counts[:, None]


def _process_group() -> tuple[int, int, bool]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _forward(model: PreferenceModel, batches: Sequence[PackedBatch], device: torch.device | str):
    """(batch, float32 CPU logits) for each packed micro-batch, in eval mode without autograd; the
    model's train/eval mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                moved = batch.to(device)
                logits = model(
                    moved.input_ids, moved.cu_seqlens, moved.position_ids, max_seqlen=moved.max_seqlen
                )
                yield batch, logits.float().cpu()
    finally:
        model.train(was_training)


def packed_logits(
    model: PreferenceModel,
    examples: Sequence[TokenizedExample],
    *,
    micro_batch_tokens: int,
    device: torch.device | str = "cpu",
) -> np.ndarray:
    """The model's raw logits `[len(examples), num_labels]` (float32), in the order of `examples`, on
    this process alone, packed as `predict` packs (the eval planner, longest first under the token
    budget). For scorers that need more than the softmax: a reward model's scores (logits 0 and 1
    are s_A and s_B, `hpref.models.heads.davidson_logits`)."""
    if not examples:
        return np.zeros((0, 3), dtype=np.float32)
    plan = plan_eval([len(e) for e in examples], world_size=1, micro_batch_tokens=micro_batch_tokens)
    out: np.ndarray | None = None
    # one rank: no fillers, and micro-batch k holds the example indices for_rank(0)[k]
    batches = _forward(model, plan.batches(0, examples), device)
    for indices, (_, logits) in zip(plan.for_rank(0), batches, strict=True):
        if out is None:
            out = np.zeros((len(examples), logits.shape[-1]), dtype=np.float32)
        out[list(indices)] = logits.numpy()
    assert out is not None
    return out


def predict(
    model: PreferenceModel,
    examples: Sequence[TokenizedExample],
    *,
    n_rows: int,
    micro_batch_tokens: int,
    device: torch.device | str = "cpu",
    filler_token_id: int = 0,
    data_parallel: DataParallelSplit | None = None,
) -> Prediction:
    """Probabilities for rows `0 .. n_rows - 1` of `examples` (see the module docstring).

    `model(input_ids, cu_seqlens, position_ids, max_seqlen=...)` returns logits [n, 3] for one
    packed micro-batch (`hpref.protocols.PreferenceModel`). Collective when a process group is up:
    every rank must call it with the same examples. The model's train/eval mode is restored after.
    `data_parallel` (`rank`, `size`, `group`) splits the views over a data-parallel group instead of
    all ranks: a tensor-parallel model's ranks score the same micro-batches together.
    """
    rank, world, distributed = _process_group()
    group = None
    if data_parallel is not None and distributed:
        rank, world, group = data_parallel.rank, data_parallel.size, data_parallel.group
    plan = plan_eval([len(e) for e in examples], world_size=world, micro_batch_tokens=micro_batch_tokens)
    rows: list[int] = []
    flags: list[bool] = []
    scored: list[np.ndarray] = []
    tokens = 0
    for batch, logits in _forward(model, plan.batches(rank, examples, filler_token_id), device):
        probs = torch.softmax(logits, dim=-1).numpy().astype(np.float64)
        real = (batch.rows >= 0).numpy()
        rows.extend(batch.rows.numpy()[real].tolist())
        flags.extend(batch.swapped.numpy()[real].tolist())
        scored.append(probs[real])
        tokens += batch.num_tokens
    local_probs = np.concatenate(scored) if scored else np.zeros((0, 3))
    if distributed:
        import torch.distributed as dist

        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (rows, flags, local_probs.tolist(), tokens), group=group)
        rows = [r for part in gathered for r in part[0]]
        flags = [f for part in gathered for f in part[1]]
        local_probs = np.array([p for part in gathered for p in part[2]], dtype=np.float64).reshape(-1, 3)
        tokens = sum(part[3] for part in gathered)
    return Prediction(
        probs=combine_views(rows, flags, local_probs, n_rows),
        sequences=len(rows),
        tokens=int(tokens),
        world_size=world,
    )
