"""The training loop: one optimizer step over packed micro-batches, evaluation, and `fit`
(start_run -> train_epoch ... -> end_run -> save_summary).

The loss of a step is the mean soft-label cross-entropy over the step's real sequences on all ranks,
whatever the packing. Each micro-batch contributes `sum(weights * ce) / step_sequences`, scaled by
the world size because FSDP averages gradients over ranks; so the gradient is that of the step mean,
and a 1-rank and an N-rank run with the same global batch follow the same curve. Gradients are
reduced once per step (`set_requires_gradient_sync(False)` on all but the last micro-batch) and the
loss is all-reduced once per step, for logging.

The model, optimizer, scheduler and loss come from the worker (`hpref.components.Components`); eval
is the shared `hpref.prediction.evaluation.evaluate_battles`, the same call `hpref eval` makes. A run
that trains something else (offline DPO: `hpref.train.dpo`) hands `fit` a `TrainObjective`, whose
step, metrics and eval replace the preference model's; the plan, logs, checkpoints and resume are
the same.
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
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from loguru import logger

from hpref.data.packing import PackedBatch, StepSampler
from hpref.logs import file_only
from hpref.memory import release_freed_memory
from hpref.models.loss import soft_cross_entropy
from hpref.prediction.evaluation import Evaluation, evaluate_battles
from hpref.protocols import (
    BattleSource,
    DataParallelSplit,
    ReducesOwnGradients,
    RunsOwnSchedule,
    SyncsGradientsOnDemand,
)
from hpref.recipe import Recipe
from hpref.runfolder import layout
from hpref.runfolder.files import write_text_atomic
from hpref.runfolder.heartbeat import clear_heartbeat, write_heartbeat
from hpref.runfolder.save_trigger import check_requests_all_ranks
from hpref.runtime.peak import Peak
from hpref.runtime.stop_signals import signal_name, stop_requested
from hpref.train import checkpoint, resume
from hpref.train.data import Tokenized
from hpref.train.head_prior import init_head_to_prior
from hpref.train.metrics import MetricsFile, summary_table
from hpref.train.progress import Interval, RunStats, progress_bar, step_flops
from hpref.train.sharding import init_weights_folder
from hpref.train.summary import summarise, summary_rows

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

#: Test hooks: make one rank raise at its first step / make every rank stop after step k / hold
#: step k in flight on rank 0 until a stop is asked ("k") or for good ("k:forever"), the step a
#: SIGTERM or Ctrl-C lands in (tests/train/test_stop_signals.py).
FAIL_RANK_ENV = "HPREF_DEBUG_FAIL_RANK"
CRASH_AFTER_ENV = "HPREF_DEBUG_CRASH_AFTER_STEP"
HOLD_STEP_ENV = "HPREF_DEBUG_HOLD_STEP"


class SimulatedCrash(RuntimeError):
    """Raised by the HPREF_DEBUG_* hooks (tests of failure handling and resume)."""


# --------------------------------------------------------------------------------------------------
# one step


def _forward(model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
    return model(batch.input_ids, batch.cu_seqlens, batch.position_ids, max_seqlen=batch.max_seqlen)


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    """Reduce gradients in this backward (the step's last micro-batch) or not (the others)."""
    if isinstance(model, SyncsGradientsOnDemand):
        model.set_requires_gradient_sync(enabled)


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
    if isinstance(model, RunsOwnSchedule):
        loss_sum = model.forward_backward([b.to(device, non_blocking=True) for b in batches], loss, scale)
    else:
        for k, batch in enumerate(batches):
            set_gradient_sync(model, k == len(batches) - 1)
            batch = batch.to(device, non_blocking=True)
            per_sequence = loss(_forward(model, batch), batch.labels) * batch.weights
            (per_sequence.sum() * scale).backward()
            loss_sum += per_sequence.detach().sum()
    # a model that reduces its own gradients (megatron-gpt: over its data-parallel group, with a
    # norm over tensor-parallel shards) clips them too; FSDP2 has reduced them during backward
    if isinstance(model, ReducesOwnGradients):
        grad_norm = model.reduce_and_clip_gradients(grad_clip)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


# --------------------------------------------------------------------------------------------------
# the loop


class TrainObjective(Protocol):
    """What a run trains other than a preference model (offline DPO: `hpref.train.dpo.DpoObjective`):
    its step, its interval metrics and eval (collective), and the per-rank state its checkpoints keep.
    `fit` is the same loop either way: plan, steps, logs, evals, checkpoints, summary."""

    @property
    def has_eval(self) -> bool: ...

    def train_step(self, setup: Any, plan: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def interval_metrics(self, sums: torch.Tensor, group: Any = None) -> dict[str, float]: ...

    def log_suffix(self, record: dict[str, Any]) -> str: ...

    def evaluate(self, setup: Any, step: int, epoch: int, metrics: MetricsFile) -> dict[str, float]: ...

    def rank_state(self) -> dict[str, Any]: ...

    def load_rank_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainSetup:
    """Everything `fit` needs, built by the worker."""

    recipe: Recipe
    run_dir: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    sampler: StepSampler
    train_data: Tokenized
    eval_data: Tokenized | None
    device: torch.device
    rank: int
    world_size: int
    total_steps: int
    filler_token_id: int
    peak: Peak
    eval_source: BattleSource | None = None
    backbone_flops: Callable[[int], float] | None = None  # flops_per_token(seq_len)
    train_source: BattleSource | None = None  # for the cheap baselines the summary prints on real data
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = soft_cross_entropy
    #: `rank`, `size`, `group` of the data-parallel split when it is not every rank (tensor parallel)
    data_parallel: DataParallelSplit | None = None
    #: set: the run trains this objective (its step and eval) instead of the preference model's
    objective: TrainObjective | None = None

    @property
    def data_rank_and_size(self) -> tuple[int, int, Any]:
        """Which share of each step's micro-batches this rank trains on, of how many, and the group
        that sums the loss (None: every rank)."""
        if self.data_parallel is None:
            return self.rank, self.world_size, None
        return self.data_parallel.rank, self.data_parallel.size, self.data_parallel.group


# --------------------------------------------------------------------------------------------------
# fit: setup -> train -> cleanup -> summary


@dataclass
class RunState:
    """What one `fit` carries from step to step."""

    metrics: MetricsFile
    stats: RunStats
    progress: Any
    task: Any
    interval: Interval = field(default_factory=Interval)
    started: float = field(default_factory=time.perf_counter)
    fail_rank: str | None = None  # the HPREF_DEBUG_* test hooks
    crash_after: int = 0
    hold_step: str = ""
    stopped_by: int = 0  # the signal a stop was asked by (SIGTERM, Ctrl-C): the run ended early


def fit(setup: TrainSetup, resume_from: Path | None = None) -> dict[str, Any]:
    """Train to `total_steps`, evaluating, logging and checkpointing on the way; returns the summary.

    Read top to bottom: `start_run` (restore or a fresh head, the metrics file, the first heartbeat),
    `train_epoch` until the last step (each step's log line, evals and checkpoints: `_after_step`),
    `end_run` (also after a failure: the heartbeat cleared), `save_summary` (the last eval,
    `summary.json`, the table). Checkpoints are `hpref.train.resume`'s, the totals and the log
    interval `hpref.train.progress`'s. A run asked to stop (SIGTERM, Ctrl-C: its launcher's
    `hpref.runtime.stop_signals`) ends after the step's checkpoint, without the summary."""
    run = start_run(setup, resume_from)
    try:
        try:
            while setup.sampler.epoch < setup.recipe.train.epochs and run.stats.step < setup.total_steps:
                if train_epoch(setup, run):
                    break
        finally:
            end_run(setup, run)
        if run.stopped_by:
            return {"stopped_by": signal_name(run.stopped_by), "step": run.stats.step}
        return save_summary(setup, run)
    finally:
        run.metrics.close()  # the loggers' files complete, also after a failure


def start_run(setup: TrainSetup, resume_from: Path | None) -> RunState:
    """Setup: the checkpoint restored (or a fresh head fitted to the label prior), the metrics file
    opened, the model in training mode and a first heartbeat (`hpref save --now` refuses a run
    without a fresh one)."""
    rank = setup.rank
    metrics = MetricsFile(setup.run_dir / layout.METRICS if rank == 0 else None)
    stats = RunStats()
    if resume_from is not None:
        stats.step = resume.restore(setup, resume_from)
    elif setup.objective is None and init_weights_folder(setup.run_dir) is None:
        init_head_to_prior(setup.model, setup.train_data)  # `hpref init` weights are used as they are
    metrics.start(stats.step if resume_from is not None else None)
    if rank == 0:  # TensorBoard, W&B, ...: only rank 0 writes, from the resumed step on
        from hpref.builtin.loggers import build_loggers

        resumed = stats.step if resume_from is not None else None
        metrics.loggers = build_loggers(setup.recipe, setup.run_dir, resumed, one_step=True)
    run = RunState(
        metrics,
        stats,
        *progress_bar(rank == 0 and sys.stderr.isatty(), setup.total_steps, stats.step),
        fail_rank=os.environ.get(FAIL_RANK_ENV),
        crash_after=int(os.environ.get(CRASH_AFTER_ENV, "0") or 0),
        hold_step=os.environ.get(HOLD_STEP_ENV, ""),
    )
    setup.model.train()
    run.started = time.perf_counter()
    if rank == 0:
        write_heartbeat(setup.run_dir, stats.step)
    run.progress.start()
    return run


def train_epoch(setup: TrainSetup, run: RunState) -> bool:
    """Train: the sampler's steps of this epoch, each followed by its logging, evals and checkpoints.
    True once the run's last step is done."""
    epoch = setup.sampler.epoch
    steps_in_epoch = len(setup.sampler.plans(epoch))
    for plan in setup.sampler:
        lr, grad_norm = _one_step(setup, run, plan)
        last = run.stats.step >= setup.total_steps
        epoch_end = setup.sampler.step == steps_in_epoch
        _after_step(setup, run, epoch, lr, grad_norm, epoch_end=epoch_end, last=last)
        if last or run.stopped_by:
            return True
    return False


def _one_step(setup: TrainSetup, run: RunState, plan: Any) -> tuple[float, torch.Tensor]:
    """One optimizer step on this rank's share of `plan`; returns its learning rate and grad norm."""
    train_cfg = setup.recipe.train
    data_rank, data_world, data_group = setup.data_rank_and_size
    if run.fail_rank is not None and int(run.fail_rank) == setup.rank:
        raise SimulatedCrash(f"{FAIL_RANK_ENV}={run.fail_rank}: rank {setup.rank} fails on purpose")
    if run.hold_step and setup.rank == 0 and int(run.hold_step.split(":")[0]) == run.stats.step + 1:
        _hold(forever=run.hold_step.endswith(":forever"))
    if setup.objective is not None:
        loss_sum, grad_norm, sums = setup.objective.train_step(setup, plan)
        run.interval.sums = sums if run.interval.sums is None else run.interval.sums + sums
    else:
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
    run.stats.step += 1
    # every rank sees the same summed loss and global grad norm, so all stop together, before this
    # step's weights can reach a checkpoint
    if not (torch.isfinite(loss_sum) and torch.isfinite(grad_norm)):
        raise _diverged(setup.run_dir, run.stats.step, loss_sum / plan.num_sequences, grad_norm)
    lengths = setup.train_data.lengths
    run.interval.losses.append(loss_sum / plan.num_sequences)
    run.interval.tokens += plan.num_tokens
    run.interval.flops += step_flops(
        setup, [lengths[i] for mbs in plan.micro_batches for mb in mbs for i in mb if i >= 0]
    )
    return lr, grad_norm


def _after_step(
    setup: TrainSetup,
    run: RunState,
    epoch: int,
    lr: float,
    grad_norm: torch.Tensor,
    *,
    epoch_end: bool,
    last: bool,
) -> None:
    """The step's progress, heartbeat, log line, evals and checkpoint, in that order."""
    train_cfg, stats = setup.recipe.train, run.stats
    run.progress.update(run.task, completed=stats.step)
    if setup.rank == 0:
        write_heartbeat(setup.run_dir, stats.step)
    # Collective (rank 0 reads the save trigger, each rank its launcher's stop request, every rank
    # learns both): a checkpoint must be taken, and a run stopped, by all ranks at the same boundary.
    save_requested, stop = check_requests_all_ranks(setup.run_dir, stop_requested(), setup.device)
    if stats.step % train_cfg.log_interval == 0 or last:
        _log_interval(setup, run, epoch, lr, grad_norm)
    # a stop skips the evals due here: its wait is bounded (the launcher's grace), an eval is not
    if not stop and train_cfg.eval_steps and stats.step % train_cfg.eval_steps == 0:
        _eval(setup, run, epoch)
    eval_epoch = train_cfg.eval_interval and (epoch + 1) % train_cfg.eval_interval == 0
    if not stop and epoch_end and eval_epoch and stats.eval_step != stats.step:
        _eval(setup, run, epoch)
    interval_due = train_cfg.checkpoint_interval and stats.step % train_cfg.checkpoint_interval == 0
    if interval_due or epoch_end or last or save_requested or stop:
        t = time.perf_counter()
        resume.save(setup, stats.step, epoch)
        run.interval.pause(time.perf_counter() - t)
    if stop:
        run.stopped_by = stop
        file_only().info(f"stopping after step {stats.step}: {signal_name(stop)} (checkpoint saved)")
    if run.crash_after and stats.step == run.crash_after:
        raise SimulatedCrash(f"{CRASH_AFTER_ENV}={run.crash_after}: stopping after step {stats.step}")


def _hold(*, forever: bool) -> None:
    """The HOLD_STEP_ENV test hook: the step stays in flight until a stop is asked (or for good,
    at most 10 minutes: a test's run is killed long before)."""
    deadline = time.monotonic() + 600
    while (forever or not stop_requested()) and time.monotonic() < deadline:
        time.sleep(0.05)


def _log_interval(setup: TrainSetup, run: RunState, epoch: int, lr: float, grad_norm: torch.Tensor) -> None:
    """One `metrics.jsonl` record and log line for the steps since the last one."""
    stats = run.stats
    record = run.interval.record(setup, step=stats.step, epoch=epoch, lr=lr, grad_norm=float(grad_norm))
    objective = ""
    if setup.objective is not None and run.interval.sums is not None:  # collective
        extra = setup.objective.interval_metrics(run.interval.sums, setup.data_rank_and_size[2])
        record.update({k: v for k, v in extra.items() if k != "loss"})
        objective = setup.objective.log_suffix(record)
    run.metrics.write(record)
    stats.add(record)
    logger.info(
        f"step {stats.step}/{setup.total_steps} loss {record['loss']:.4f}{objective} lr {lr:.2e} "
        f"grad {record['grad_norm']:.3f} {record['tokens_per_s']:,.0f} tok/s "
        f"mfu {record['mfu']:.1%} {record['step_time_s']:.2f} s/step "
        f"mem {record['peak_memory_gib']:.2f} GiB"
    )
    run.progress.update(run.task, info=f"loss {record['loss']:.4f}")
    run.interval = Interval()


def _eval(setup: TrainSetup, run: RunState, epoch: int) -> None:
    objective = setup.objective
    if objective is None and setup.eval_data is None:
        return
    if objective is not None and not objective.has_eval:
        return
    t = time.perf_counter()
    if objective is not None:
        run.stats.eval = objective.evaluate(setup, run.stats.step, epoch, run.metrics)
    else:
        run.stats.eval = _evaluate_and_write(setup, run.stats.step, epoch, run.metrics)
    run.stats.eval_step = run.stats.step
    run.interval.pause(time.perf_counter() - t)


def end_run(setup: TrainSetup, run: RunState) -> None:
    """Cleanup, after the last step or a failure: the progress bar stopped, the heartbeat cleared."""
    run.progress.stop()
    if setup.rank == 0:
        clear_heartbeat(setup.run_dir)


def save_summary(setup: TrainSetup, run: RunState) -> dict[str, Any]:
    """The last eval (unless the last step had one), then `summary.json` and the table (rank 0)."""
    if setup.recipe.train.eval_interval and run.stats.eval_step != run.stats.step:
        _eval(setup, run, setup.sampler.epoch)
    summary = summarise(setup, run.stats, time.perf_counter() - run.started)
    if setup.rank == 0:
        rows = summary_rows(setup, summary)  # adds the baselines to the summary
        write_text_atomic(setup.run_dir / layout.SUMMARY, json.dumps(summary, indent=2) + "\n")
        run.metrics.log_summary(summary)
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


def _evaluate_and_write(setup: TrainSetup, step: int, epoch: int, metrics: MetricsFile) -> Evaluation:
    """Evaluate, write the predictions (rank 0), log and record the metrics."""
    assert setup.eval_data is not None and setup.eval_data.battles is not None
    t = time.perf_counter()
    battles = setup.eval_data.battles
    result = evaluate_battles(  # the one evaluation `hpref eval` runs too; rank 0 writes the files
        setup.model,
        battles,
        examples=setup.eval_data.examples,
        micro_batch_tokens=setup.recipe.train.micro_batch_tokens,
        device=setup.device,
        filler_token_id=setup.filler_token_id,
        data_parallel=setup.data_parallel,
        write_to=[
            setup.run_dir / layout.PREDICTIONS_DIR / layout.STEP_PREDICTIONS.format(step=step),
            setup.run_dir / layout.PREDICTIONS,
        ],
        unique_ids=False,
    )
    assert result.log_loss is not None and result.accuracy is not None  # eval battles are labelled
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
