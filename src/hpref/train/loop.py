"""The training loop: one optimizer step over packed micro-batches, evaluation, and `fit`.

The loss of a step is the mean soft-label cross-entropy over the step's real sequences on all ranks,
whatever the packing. Each micro-batch contributes `sum(weights * ce) / step_sequences`, scaled by
the world size because FSDP averages gradients over ranks; so the gradient is that of the step mean,
and a 1-rank and an N-rank run with the same global batch follow the same curve. Gradients are
reduced once per step (`set_requires_gradient_sync(False)` on all but the last micro-batch) and the
loss is all-reduced once per step, for logging.

The model, optimizer, scheduler and loss come from the worker (`hpref.components.Components`); eval
is the shared `hpref.prediction.predict`, scored by `hpref.prediction.metrics`, exactly what
`hpref eval` computes.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from loguru import logger

from hpref.data.packing import PackedBatch, StepSampler
from hpref.memory import release_freed_memory
from hpref.models.loss import soft_cross_entropy
from hpref.prediction.files import write_predictions
from hpref.prediction.metrics import accuracy, log_loss
from hpref.prediction.predict import predict
from hpref.recipe import Recipe
from hpref.runfolder import layout
from hpref.train import checkpoint
from hpref.train.data import Tokenized
from hpref.train.head_prior import init_head_to_prior
from hpref.train.metrics import MetricsFile, Peak, peak_memory_gib, summary_table
from hpref.train.summary import summarise, summary_rows

#: Test hooks: make one rank raise at its first step / make every rank stop after step k.
FAIL_RANK_ENV = "HPREF_DEBUG_FAIL_RANK"
CRASH_AFTER_ENV = "HPREF_DEBUG_CRASH_AFTER_STEP"


class SimulatedCrash(RuntimeError):
    """Raised by the HPREF_DEBUG_* hooks (tests of failure handling and resume)."""


# --------------------------------------------------------------------------------------------------
# one step


def _forward(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    return model(batch.input_ids, batch.cu_seqlens, batch.position_ids, max_seqlen=batch.max_seqlen)


def _set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[PackedBatch],
    *,
    step_sequences: int,
    world_size: int,
    grad_clip: float | None,
    device: torch.device,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = soft_cross_entropy,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward every micro-batch of this rank, clip, step. `loss(logits, labels)` is per
    sequence (the recipe's, `Components.loss`). Returns (this rank's summed per-sequence loss,
    detached; the global grad norm before clipping)."""
    loss_sum = torch.zeros((), device=device)
    scale = world_size / step_sequences  # world_size: the ranks the data is split over
    # a model that runs its own schedule (megatron-gpt's pipeline stages) does every micro-batch
    own_schedule = getattr(model, "forward_backward", None)
    if own_schedule is not None:
        loss_sum = own_schedule([b.to(device, non_blocking=True) for b in batches], loss, scale)
    else:
        for k, batch in enumerate(batches):
            _set_gradient_sync(model, k == len(batches) - 1)
            batch = batch.to(device, non_blocking=True)
            per_sequence = loss(_forward(model, batch), batch.labels) * batch.weights
            (per_sequence.sum() * scale).backward()
            loss_sum += per_sequence.detach().sum()
    # a model that reduces its own gradients (megatron-gpt: over its data-parallel group, with a
    # norm over tensor-parallel shards) clips them too; FSDP2 has reduced them during backward
    own_reduction = getattr(model, "reduce_and_clip_gradients", None)
    if own_reduction is not None:
        grad_norm = own_reduction(grad_clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


# --------------------------------------------------------------------------------------------------
# evaluation


@dataclass
class EvalResult:
    probs: np.ndarray  # [n, 3], row i = battle i
    labels: np.ndarray  # [n, 3]
    log_loss: float
    accuracy: float


def evaluate(
    model: torch.nn.Module,
    data: Tokenized,
    *,
    micro_batch_tokens: int,
    device: torch.device,
    filler_token_id: int,
    data_parallel: Any = None,
) -> EvalResult:
    """Score every eval battle once over all ranks (`hpref.prediction.predict`, collective) and
    score the probabilities against the battles' labels (`hpref.prediction.metrics`)."""
    assert data.battles is not None
    prediction = predict(
        model,
        data.examples,
        n_rows=len(data.battles),
        micro_batch_tokens=micro_batch_tokens,
        device=device,
        filler_token_id=filler_token_id,
        data_parallel=data_parallel,
    )
    labels = np.array([b.label for b in data.battles], dtype=np.float64)
    return EvalResult(
        probs=prediction.probs,
        labels=labels,
        log_loss=log_loss(prediction.probs, labels),
        accuracy=accuracy(prediction.probs, labels),
    )


# --------------------------------------------------------------------------------------------------
# the loop


@dataclass
class TrainSetup:
    """Everything `fit` needs, built by the worker."""

    recipe: Recipe
    run_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: StepSampler
    train_data: Tokenized
    eval_data: Tokenized | None
    device: torch.device
    rank: int
    world_size: int
    total_steps: int
    filler_token_id: int
    peak: Peak
    eval_source: Any = None
    backbone_flops: Any = None  # flops_per_token(seq_len)
    train_source: Any = None  # for the cheap baselines the summary prints on real data
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = soft_cross_entropy
    #: `rank`, `size`, `group` of the data-parallel split when it is not every rank (tensor parallel)
    data_parallel: Any = None

    @property
    def data_rank_and_size(self) -> tuple[int, int, Any]:
        """Which share of each step's micro-batches this rank trains on, of how many, and the group
        that sums the loss (None: every rank)."""
        if self.data_parallel is None:
            return self.rank, self.world_size, None
        return self.data_parallel.rank, self.data_parallel.size, self.data_parallel.group


@dataclass
class RunStats:
    """Totals over the run, for the summary."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    flops: float = 0.0
    last_loss: float = float("nan")
    eval: EvalResult | None = None
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

    def pause(self, seconds: float) -> None:
        self.start += seconds

    def record(
        self, setup: TrainSetup, *, step: int, epoch: int, lr: float, grad_norm: float
    ) -> dict[str, Any]:
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


def _step_flops(setup: TrainSetup, lengths: Sequence[int]) -> float:
    if setup.backbone_flops is None or not lengths:
        return 0.0
    tokens = sum(lengths)
    effective = sum(n * n for n in lengths) / tokens
    return setup.backbone_flops(effective) * tokens


def _progress(enabled: bool, total: int, completed: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

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


def fit(setup: TrainSetup, resume_from: Path | None = None) -> dict[str, Any]:
    """Train to `total_steps`, evaluating, logging and checkpointing on the way; returns the summary."""
    train_cfg = setup.recipe.train
    rank = setup.rank
    data_rank, data_world, data_group = setup.data_rank_and_size
    metrics = MetricsFile(setup.run_dir / layout.METRICS if rank == 0 else None)
    stats = RunStats()
    if resume_from is not None:
        stats.step = _restore(setup, resume_from)
    else:
        from hpref.train.sharding import init_weights_folder

        if init_weights_folder(setup.run_dir) is None:  # `hpref init` weights are used as they are
            init_head_to_prior(setup.model, setup.train_data)
    metrics.start(stats.step if resume_from is not None else None)
    fail_rank = os.environ.get(FAIL_RANK_ENV)
    crash_after = int(os.environ.get(CRASH_AFTER_ENV, "0") or 0)
    lengths = setup.train_data.lengths
    interval = Interval()

    def do_eval(epoch: int) -> None:
        if setup.eval_data is None:
            return
        t = time.perf_counter()
        stats.eval, stats.eval_step = _evaluate_and_write(setup, stats.step, epoch, metrics), stats.step
        interval.pause(time.perf_counter() - t)

    def save(epoch: int) -> None:
        t = time.perf_counter()
        checkpoint.save_checkpoint(
            setup.run_dir,
            stats.step,
            model=setup.model,
            optimizer=setup.optimizer,
            train_state={
                "epoch": epoch,
                "sampler": setup.sampler.state_dict(),
                "scheduler": setup.scheduler.state_dict(),
                "total_steps": setup.total_steps,
                **_base_pointer(setup),
            },
            keep=train_cfg.keep_checkpoints,
            rank_state={"scheduler": setup.scheduler.state_dict()},  # its groups may differ by rank
        )
        interval.pause(time.perf_counter() - t)

    from hpref.runfolder.heartbeat import clear_heartbeat, write_heartbeat
    from hpref.runfolder.save_trigger import check_save_trigger_all_ranks

    def _train_epochs() -> None:
        nonlocal interval
        with progress:
            while setup.sampler.epoch < train_cfg.epochs and stats.step < setup.total_steps:
                epoch = setup.sampler.epoch
                steps_in_epoch = len(setup.sampler.plans(epoch))
                for plan in setup.sampler:
                    if fail_rank is not None and int(fail_rank) == rank:
                        raise SimulatedCrash(f"{FAIL_RANK_ENV}={fail_rank}: rank {rank} fails on purpose")
                    loss_sum, grad_norm = train_step(
                        setup.model,
                        setup.optimizer,
                        plan.batches(data_rank, setup.train_data.examples, setup.filler_token_id),
                        step_sequences=plan.num_sequences,
                        world_size=data_world,
                        grad_clip=train_cfg.grad_clip,
                        device=setup.device,
                        loss=setup.loss,
                    )
                    if setup.device.type == "cpu":
                        release_freed_memory()  # see hpref.memory: flat RSS across step lengths
                    lr = setup.scheduler.get_last_lr()[0]
                    setup.scheduler.step()
                    dist.all_reduce(loss_sum, group=data_group)  # the one loss reduction of the step
                    stats.step += 1
                    # every rank sees the same summed loss and global grad norm, so all stop together,
                    # before this step's weights can reach a checkpoint
                    if not (torch.isfinite(loss_sum) and torch.isfinite(grad_norm)):
                        raise _diverged(setup.run_dir, stats.step, loss_sum / plan.num_sequences, grad_norm)
                    interval.losses.append(loss_sum / plan.num_sequences)
                    interval.tokens += plan.num_tokens
                    interval.flops += _step_flops(
                        setup, [lengths[i] for mbs in plan.micro_batches for mb in mbs for i in mb if i >= 0]
                    )
                    epoch_end = setup.sampler.step == steps_in_epoch
                    last = stats.step >= setup.total_steps
                    progress.update(task, completed=stats.step)
                    if rank == 0:
                        write_heartbeat(setup.run_dir, stats.step)
                    # Collective (rank 0 reads the trigger file, every rank learns the answer): a
                    # checkpoint must be taken by all ranks at the same step boundary.
                    save_requested = check_save_trigger_all_ranks(setup.run_dir)

                    if stats.step % train_cfg.log_interval == 0 or last:
                        record = interval.record(
                            setup, step=stats.step, epoch=epoch, lr=lr, grad_norm=float(grad_norm)
                        )
                        metrics.write(record)
                        stats.add(record)
                        logger.info(
                            f"step {stats.step}/{setup.total_steps} loss {record['loss']:.4f} lr {lr:.2e} "
                            f"grad {record['grad_norm']:.3f} {record['tokens_per_s']:,.0f} tok/s "
                            f"mfu {record['mfu']:.1%} {record['step_time_s']:.2f} s/step "
                            f"mem {record['peak_memory_gib']:.2f} GiB"
                        )
                        progress.update(task, info=f"loss {record['loss']:.4f}")
                        interval = Interval()

                    if train_cfg.eval_steps and stats.step % train_cfg.eval_steps == 0:
                        do_eval(epoch)
                    eval_epoch = train_cfg.eval_interval and (epoch + 1) % train_cfg.eval_interval == 0
                    if epoch_end and eval_epoch and stats.eval_step != stats.step:
                        do_eval(epoch)
                    interval_due = (
                        train_cfg.checkpoint_interval and stats.step % train_cfg.checkpoint_interval == 0
                    )
                    if interval_due or epoch_end or last or save_requested:
                        save(epoch)
                    if crash_after and stats.step == crash_after:
                        raise SimulatedCrash(
                            f"{CRASH_AFTER_ENV}={crash_after}: stopping after step {stats.step}"
                        )
                    if last:
                        break

    setup.model.train()
    run_start = time.perf_counter()
    progress, task = _progress(rank == 0 and sys.stderr.isatty(), setup.total_steps, stats.step)
    if rank == 0:  # `hpref save --now` refuses a run without a fresh heartbeat
        write_heartbeat(setup.run_dir, stats.step)
    try:
        _train_epochs()
    finally:
        if rank == 0:
            clear_heartbeat(setup.run_dir)
    if train_cfg.eval_interval and stats.eval_step != stats.step:
        do_eval(setup.sampler.epoch)
    summary = summarise(setup, stats, time.perf_counter() - run_start)
    if rank == 0:
        rows = summary_rows(setup, summary)  # adds the baselines to the summary
        from hpref.runfolder.files import write_text_atomic

        write_text_atomic(setup.run_dir / layout.SUMMARY, json.dumps(summary, indent=2) + "\n")
        from rich.console import Console

        Console().print(summary_table(rows, title=f"hpref train: {setup.run_dir}"))
    return summary


def _diverged(run_dir: Path, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Exception:
    from hpref.errors import TrainingDiverged

    last_good = checkpoint.find_latest(run_dir)
    where = (
        f"the last good checkpoint is {last_good} (resume it with --resume auto, e.g. with a lower "
        "optimizer.lr)"
        if last_good is not None
        else "there is no checkpoint before it"
    )
    return TrainingDiverged(
        f"step {step}: training loss {float(loss):.4g}, gradient norm {float(grad_norm):.4g} (not "
        f"finite); stopped without saving; {where}"
    )


def _restore(setup: TrainSetup, path: Path) -> int:
    """Load a checkpoint into the setup; returns the number of completed steps."""
    from hpref.errors import UserError

    expected = _base_pointer(setup).get("base_model")
    saved = _read_base_pointer(path)
    if expected is not None and saved is not None and saved != expected:
        # the adapters only mean something on the base they were trained on
        raise UserError(
            f"cannot resume from {path}: its adapters were trained on the base model {json.dumps(saved)}, "
            f"and this recipe's [model] is {json.dumps(expected)}"
        )
    restored = checkpoint.load_checkpoint(path, model=setup.model, optimizer=setup.optimizer)
    try:
        setup.sampler.load_state_dict(restored.train_state["sampler"])
    except ValueError as exc:
        raise UserError(f"cannot resume from {path}: {exc}") from None
    # this rank's own (a pipeline stage's parameter groups differ), else rank 0's (older checkpoints)
    setup.scheduler.load_state_dict(restored.rank_state.get("scheduler", restored.train_state["scheduler"]))
    return int(restored.train_state["step"])


def _base_pointer(setup: TrainSetup) -> dict[str, Any]:
    """For a LoRA run, what a checkpoint needs to name the frozen base weights it leaves out."""
    if setup.recipe.lora is None:
        return {}
    from hpref.models.adapters import base_pointer

    return {"base_model": base_pointer(setup.recipe)}


def _read_base_pointer(path: Path) -> Any:
    try:
        return json.loads((Path(path) / checkpoint.TRAIN_STATE).read_text(encoding="utf-8")).get("base_model")
    except (OSError, ValueError, AttributeError):
        return None  # load_checkpoint names what is wrong with the file


def _evaluate_and_write(setup: TrainSetup, step: int, epoch: int, metrics: MetricsFile) -> EvalResult:
    """Evaluate, write the predictions (rank 0), log and record the metrics."""
    assert setup.eval_data is not None and setup.eval_data.battles is not None
    t = time.perf_counter()
    result = evaluate(
        setup.model,
        setup.eval_data,
        micro_batch_tokens=setup.recipe.train.micro_batch_tokens,
        device=setup.device,
        filler_token_id=setup.filler_token_id,
        data_parallel=setup.data_parallel,
    )
    battles = setup.eval_data.battles
    if setup.rank == 0:
        ids = [b.id for b in battles]
        for path in (
            setup.run_dir / layout.PREDICTIONS_DIR / layout.STEP_PREDICTIONS.format(step=step),
            setup.run_dir / layout.PREDICTIONS,
        ):
            write_predictions(path, ids, result.probs, unique_ids=False)
    seconds = time.perf_counter() - t
    metrics.write(
        {
            "kind": "eval",
            "step": step,
            "epoch": epoch,
            "eval_log_loss": result.log_loss,
            "eval_accuracy": result.accuracy,
            "eval_battles": len(battles),
            "eval_seconds": seconds,
        }
    )
    logger.info(
        f"eval step {step}: log loss {result.log_loss:.4f}, accuracy {result.accuracy:.3f} "
        f"({len(battles)} battles, {seconds:.1f}s)"
    )
    return result
