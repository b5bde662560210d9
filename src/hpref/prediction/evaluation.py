"""The one evaluation: a model + battles -> probabilities, scores when labelled, prediction files.

Both the train loop's eval (`hpref.train.loop`) and `hpref eval` (`hpref.evaluate.runner`) call
`evaluate_battles`. The views are the caller's tokenized examples (the trainer's eval data, encoded
once per run) or encoded here by `formatter` exactly as in training (`hpref.data.cache.encode_views`,
both orders with swap TTA); `hpref.prediction.predict` scores them (packed micro-batches, all_gather
over ranks when a process group is up, swapped views mapped back and averaged); labelled battles get
their log loss and accuracy (`hpref.prediction.metrics`); rank 0 writes the prediction files asked
for (`hpref.prediction.files`). Collective under a process group: every rank calls it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from loguru import logger

from hpref.data.records import Battle
from hpref.errors import UserError
from hpref.protocols import DataParallelSplit, Formatter, PreferenceModel


@dataclass
class Evaluation:
    """Probabilities per battle (`probs[i]` for `ids[i]`), what scoring them took, and their scores
    against the battles' labels (None when a battle is unlabelled)."""

    ids: list[str]
    probs: np.ndarray  # [n, 3]
    seconds: float
    sequences: int
    tokens: int
    world_size: int = 1
    timings: dict[str, float] = field(default_factory=dict)
    labels: np.ndarray | None = None  # [n, 3]
    log_loss: float | None = None
    accuracy: float | None = None

    @property
    def rows_per_s(self) -> float:
        """Battles per second over the whole call (tokenization included), all ranks."""
        return len(self.ids) / self.seconds if self.seconds > 0 else float("inf")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def evaluate_battles(
    model: PreferenceModel,
    battles: Sequence[Battle],
    *,
    examples: Sequence[Any] | None = None,
    formatter: Formatter | None = None,
    tta: bool = False,
    micro_batch_tokens: int = 8192,
    device: Any = "cpu",
    filler_token_id: int | None = None,
    data_parallel: DataParallelSplit | None = None,
    write_to: Sequence[str | Path] = (),
    unique_ids: bool = True,
) -> Evaluation:
    """Score every battle once over all ranks; see the module docstring.

    `examples`: the battles' tokenized views (row i = battle i); without them `formatter` encodes
    the battles here (`tta`: both orders). `filler_token_id` defaults to the model tokenizer's pad
    id. `write_to`: prediction files rank 0 writes (`unique_ids=False` lets repeated ids through)."""
    from hpref.prediction.files import write_predictions
    from hpref.prediction.metrics import accuracy, log_loss
    from hpref.prediction.predict import predict

    if not battles:
        raise UserError("nothing to predict: the data has no battles")
    start = time.perf_counter()
    if examples is None:
        from hpref.data.cache import encode_views
        from hpref.data.formatting import check_pairing

        check_pairing(formatter, model)
        if tta and model.paired:
            # a reward model scores A and B alone: the swapped view is this one mirrored, exactly
            logger.info("--tta swap: a reward model is symmetric in A and B; scoring each battle once")
            tta = False
        examples = encode_views(battles, formatter, both_views=tta).examples()
    if filler_token_id is None:
        pad = model.tokenizer.pad_token_id
        filler_token_id = int(pad) if pad is not None else 0
    tokenized = time.perf_counter()
    prediction = predict(
        model,
        examples,
        n_rows=len(battles),
        micro_batch_tokens=micro_batch_tokens,
        device=device,
        filler_token_id=filler_token_id,
        data_parallel=data_parallel,
    )
    end = time.perf_counter()
    result = Evaluation(
        ids=[b.id for b in battles],
        probs=prediction.probs,
        seconds=end - start,
        sequences=prediction.sequences,
        tokens=prediction.tokens,
        world_size=prediction.world_size,
        timings={"tokenize_s": tokenized - start, "score_s": end - tokenized},
    )
    if all(b.label is not None for b in battles):
        result.labels = np.array([b.label for b in battles], dtype=np.float64)
        result.log_loss = log_loss(result.probs, result.labels)
        result.accuracy = accuracy(result.probs, result.labels)
    if write_to and _rank() == 0:
        for path in write_to:
            write_predictions(path, result.ids, result.probs, unique_ids=unique_ids)
    return result
