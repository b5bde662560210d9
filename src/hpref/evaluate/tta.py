"""Swap test-time augmentation: score each battle as A/B and as B/A, map the swap back, average.

A judge trained without swap augmentation (or too little of it) learns where an answer sits, not
only what it says: "the first answer wins slightly more often". Showing it both orders and averaging
cancels any such position effect exactly in the A-vs-B direction: for a battle whose two answers
are identical, the averaged p_a and p_b are equal whatever the model's bias.

The mapping back: the swapped view's (p_a, p_b, p_tie) are the probabilities that the answer shown
first (the original B), the answer shown second (the original A), or neither wins, so in the
original's terms they are (p_b, p_a, p_tie). `unswap` exchanges the first two columns.

Averaging is arithmetic (a mixture of the two views), so the result is a distribution and inherits
the views' calibration; it costs twice the scoring time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hpref.data.records import Battle

#: scores one packed micro-batch: probabilities [n_sequences, 3], fillers included (rows == -1)
BatchScorer = Callable[[Any], Any]
#: one battle (as shown) -> token ids
Encoder = Callable[[Battle], Sequence[int]]


def unswap(probs: Any) -> np.ndarray:
    """Probabilities of a swapped view in the original battle's terms: (p_b, p_a, p_tie)."""
    p = np.asarray(probs, dtype=np.float64)
    return p[..., [1, 0, 2]]


def combine_views(rows: Sequence[int], swapped: Sequence[bool], probs: Any, n_rows: int) -> np.ndarray:
    """Average the views of each row after mapping swapped views back; [n_rows, 3].

    Raises when a row has no view (a lost battle must never become a silent uniform prediction).
    """
    p = np.asarray(probs, dtype=np.float64)
    rows_arr = np.asarray(rows, dtype=np.int64)
    flags = np.asarray(swapped, dtype=bool)
    if not (len(rows_arr) == len(flags) == len(p)):
        raise ValueError("rows, swapped and probs must have one entry per view")
    keep = rows_arr >= 0  # fillers
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


def score_views(
    examples: Sequence[Any],
    score_batch: BatchScorer,
    *,
    micro_batch_tokens: int,
    rank: int = 0,
    world_size: int = 1,
    filler_token_id: int = 0,
) -> tuple[list[int], list[bool], np.ndarray, int]:
    """Score this rank's share of `examples` (TokenizedExample) with the eval planner.

    Returns (rows, swapped, probs [m, 3], real tokens scored) for this rank; fillers dropped.
    """
    from hpref.data.packing import plan_eval

    plan = plan_eval([len(e) for e in examples], world_size=world_size, micro_batch_tokens=micro_batch_tokens)
    rows: list[int] = []
    flags: list[bool] = []
    out: list[np.ndarray] = []
    tokens = 0
    for batch in plan.batches(rank, examples, filler_token_id):
        probs = np.asarray(_to_numpy(score_batch(batch)), dtype=np.float64)
        batch_rows = batch.rows.numpy()
        real = batch_rows >= 0
        rows.extend(batch_rows[real].tolist())
        flags.extend(batch.swapped.numpy()[real].tolist())
        out.append(probs[real])
        tokens += batch.num_tokens
    probs = np.concatenate(out) if out else np.zeros((0, 3))
    return rows, flags, probs, tokens


def _to_numpy(x: Any) -> Any:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return x


def view_examples(
    battles: Sequence[Battle], encode: Encoder | None = None, *, formatter: Any = None, tta: bool
):
    """TokenizedExamples for each battle (row = index) and, with `tta`, its swap (`swapped=True`).

    Give `formatter` (uses `encode_many` when it has one: batched tokenization) or `encode`.
    """
    from hpref.data.formatting import Encoded, encode_battles
    from hpref.data.packing import TokenizedExample

    views: list[tuple[int, bool, Battle]] = [(i, False, b) for i, b in enumerate(battles)]
    if tta:
        views += [(i, True, b.swapped()) for i, b in enumerate(battles)]
    shown = [b for _, _, b in views]
    if formatter is not None:
        encoded = encode_battles(formatter, shown)
    else:
        encoded = [Encoded(ids, False, len(ids)) for ids in (list(encode(b)) for b in shown)]
    return [
        TokenizedExample(
            ids=np.asarray(e.ids, dtype=np.int32), label=b.label, row=row, swapped=flag, split=e.split
        )
        for (row, flag, b), e in zip(views, encoded, strict=True)
    ]


def predict_with_swap_tta(
    battles: Sequence[Battle],
    encode: Encoder,
    score_batch: BatchScorer,
    *,
    micro_batch_tokens: int = 4096,
    tta: bool = True,
) -> np.ndarray:
    """Probabilities [n, 3] per battle (single process): both orders averaged when `tta`."""
    examples = view_examples(battles, encode, tta=tta)
    rows, flags, probs, _ = score_views(examples, score_batch, micro_batch_tokens=micro_batch_tokens)
    return combine_views(rows, flags, probs, len(battles))
