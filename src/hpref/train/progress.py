"""What a training run has done so far: the totals its summary reports (`RunStats`), the interval
since the last log line (`Interval`: losses, real tokens, FLOPs, training seconds, turned into one
`metrics.jsonl` record) and the progress bar. `hpref.train.loop.fit` keeps one of each.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# at import, before the worker seeds and restores Python's RNG: rich.style draws from it once when
# first imported, so importing rich after a resume put a resumed run's RNG one draw ahead of the
# uninterrupted run's (found by tests/train/test_engine.py's chaos test, comparing checkpoints)
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from hpref.train.metrics import peak_memory_gib


@dataclass
class RunStats:
    """Totals over the run, for the summary."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    last_loss: float = float("nan")
    eval: Any = None  # the last `hpref.prediction.evaluation.Evaluation`
    eval_step: int = -1

    def add(self, record: dict[str, Any]) -> None:
        self.tokens += record["tokens"]
        self.seconds += record["seconds"]
        self.flops += record["flops"]
        self.last_loss = record["loss"]


@dataclass
class Interval:
    """What happened since the last log line: step losses, real tokens, FLOPs, training seconds
    (eval and checkpoint time is excluded by `pause`)."""

    losses: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    flops: float = 0.0
    start: float = field(default_factory=time.perf_counter)
    sums: torch.Tensor | None = None  # a `TrainObjective`'s metric sums, this rank's, over the interval

    def pause(self, seconds: float) -> None:
        self.start += seconds

    def record(self, setup: Any, *, step: int, epoch: int, lr: float, grad_norm: float) -> dict[str, Any]:
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        elapsed = time.perf_counter() - self.start
        losses = torch.stack(self.losses).tolist()
        tps = self.tokens / elapsed
        return {
            "kind": "train",
            "step": step,
            "epoch": epoch,
            "loss": sum(losses) / len(losses),
            "step_loss": losses[-1],
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps / setup.world_size,
            "mfu": self.flops / elapsed / setup.world_size / setup.peak.flops,
            "step_time_s": elapsed / len(losses),
            "peak_memory_gib": peak_memory_gib(setup.device),
            "seconds": elapsed,
            "tokens": self.tokens,
            "flops": self.flops,
        }


def step_flops(setup: Any, lengths: Sequence[int]) -> float:
    """The backbone FLOPs of one step's sequences (attention at their effective length)."""
    if setup.backbone_flops is None or not lengths:
        return 0.0
    tokens = sum(lengths)
    effective = sum(n * n for n in lengths) / tokens
    return setup.backbone_flops(effective) * tokens


def progress_bar(enabled: bool, total: int, completed: int):
    """The rank-0 progress bar on a terminal (disabled elsewhere) and its task."""
    progress = Progress(
        TextColumn("train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        disable=not enabled,
        transient=False,
    )
    task = progress.add_task("train", total=total, completed=completed, info="")
    return progress, task
