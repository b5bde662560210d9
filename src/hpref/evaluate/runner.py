"""Inference: a model (export folder, checkpoint or run folder) + battles -> probabilities per battle id.

Flow: battles -> views (each battle, and its swap with TTA) -> token ids (the recipe's formatter at
the recipe's max_length, exactly as in training) -> the eval planner's packed micro-batches, longest
first, under a token budget -> softmax of the model's logits under `torch.inference_mode` -> views
combined per battle (`tta.combine_views`).

Several processes: when a process group is initialised (torchrun), each rank scores its share of the
eval plan and the (row, swapped, probs) triples are all-gathered, as the trainer's eval does; every
rank returns the full result. Without one, it is a single process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from loguru import logger

from hpref.data.records import Battle
from hpref.errors import UserError
from hpref.evaluate.tta import combine_views, score_views, view_examples


@dataclass
class PredictResult:
    ids: list[str]
    probs: np.ndarray  # [n, 3]
    seconds: float
    sequences: int
    tokens: int
    world_size: int = 1
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def rows_per_s(self) -> float:
        """Battles per second over the whole predict call (tokenization included), all ranks."""
        return len(self.ids) / self.seconds if self.seconds > 0 else float("inf")


def is_export_folder(path: Path) -> bool:
    from hpref.models.preference import EXPORT_JSON

    return (Path(path) / EXPORT_JSON).is_file()


def load_model(source: str | Path, recipe: Any = None, *, device: str | torch.device = "cpu") -> Any:
    """An export folder (`hpref save` output), a checkpoint folder or a run folder (latest checkpoint)."""
    from hpref.evaluate.export import load_model_from_checkpoint, resolve_checkpoint
    from hpref.models.preference import PreferenceModel

    source = Path(source)
    if is_export_folder(source):
        model = PreferenceModel.from_pretrained(source, device=device)
    else:
        model = load_model_from_checkpoint(resolve_checkpoint(source), recipe, device=str(device)).model
    model.eval()
    return model


def build_formatter(recipe: Any, tokenizer: Any, max_length: int | None = None) -> Any:
    """The recipe's formatter at the recipe's (or the given) max_length; `pab` without a recipe."""
    from hpref.plugins import load_plugins

    registry = load_plugins()
    if recipe is not None:
        component, config = registry.get("formatter", recipe.formatter.name), recipe.formatter.config
    else:
        component = registry.get("formatter", "pab")
        config = component.config()
    length = max_length or (recipe.train.max_length if recipe is not None else 1024)
    return component.build(config, tokenizer, length)


def model_scorer(model: Any, device: torch.device | str):
    """`PackedBatch -> probabilities [n, 3]` for the model, on `device`, without autograd state."""

    def score(batch: Any) -> torch.Tensor:
        batch = batch.to(device)
        logits = model(batch.input_ids, batch.cu_seqlens, batch.position_ids, max_seqlen=batch.max_seqlen)
        return torch.softmax(logits.float(), dim=-1)

    return score


def predict(
    model: Any,
    battles: Sequence[Battle],
    formatter: Any,
    *,
    micro_batch_tokens: int = 8192,
    tta: bool = False,
    device: torch.device | str = "cpu",
) -> PredictResult:
    """Probabilities for every battle (ids in `battles` order); see the module docstring."""
    import torch.distributed as dist

    if not battles:
        raise UserError("nothing to predict: the data has no battles")
    from hpref.data.formatting import check_pairing

    check_pairing(formatter, model)
    if tta and getattr(model, "paired", False):
        # a reward model scores A and B alone: the swapped view is this one mirrored, exactly
        logger.info("--tta swap: a reward model is symmetric in A and B; scoring each battle once")
        tta = False
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    start = time.perf_counter()
    examples = view_examples(battles, formatter=formatter, tta=tta)
    tokenized = time.perf_counter()
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            rows, flags, probs, tokens = score_views(
                examples,
                model_scorer(model, device),
                micro_batch_tokens=micro_batch_tokens,
                rank=rank,
                world_size=world,
                filler_token_id=int(pad) if pad is not None else 0,
            )
    finally:
        model.train(was_training)
    if distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (rows, flags, probs.tolist(), tokens))
        rows = [r for part in gathered for r in part[0]]
        flags = [f for part in gathered for f in part[1]]
        probs = np.array([p for part in gathered for p in part[2]], dtype=np.float64).reshape(-1, 3)
        tokens = sum(part[3] for part in gathered)
    combined = combine_views(rows, flags, probs, len(battles))
    end = time.perf_counter()
    return PredictResult(
        ids=[b.id for b in battles],
        probs=combined,
        seconds=end - start,
        sequences=len(examples),
        tokens=int(tokens),
        world_size=world,
        timings={"tokenize_s": tokenized - start, "score_s": end - tokenized},
    )
