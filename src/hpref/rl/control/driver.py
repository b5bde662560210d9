"""The driver of `hpref rl`: one asyncio task per policy, coordinated by the leader.

    result = await drive(config, ["a", "b"], handles, run_dir, starts, metrics)

- The leader (the first policy named) runs `num_rollouts` rollouts; followers run until it ends.
  The first task to fail ends the run, and its error is the run's error.
- Every `save_interval` leader rollouts (and at the end, at `debug_exit_after_rollout`, when
  `hpref save --now` asks through `<run_dir>/SAVE_NOW`, and when SIGTERM or Ctrl-C asks the run to
  stop: `hpref.rl.control.stop`) the leader parks every follower, saves every trainer and then the executor,
  writes `record.json`, and releases them. Evals park through a separate parker.
- Weights go from trainer to engine every `update_weights_interval` rollouts of that policy.
- While the policies run, the event loop refreshes `<run_dir>/heartbeat.json` every few seconds,
  which is how `hpref save --now` knows the run is alive (`hpref.runfolder.heartbeat`).

The driver only coordinates: numbers come from `hpref.rl.algorithms.objectives` (inside the trainers), the
resume rules from `hpref.rl.control.record`, the rendezvous from `hpref.rl.control.parking`. The Ray shell
around it (actors, restore, teardown, the summary) is `hpref.rl.launch.run_rl`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from hpref.recipe.rl import RLConfig
from hpref.rl.control.parking import Parker
from hpref.rl.control.record import CheckpointRecord, check_resume, read_record, write_record
from hpref.rl.control.stop import StopSignals
from hpref.rl.placement.resources import colocated
from hpref.rl.report.metrics import MetricsWriter, eval_line, eval_row, rollout_metrics
from hpref.rl.trainer.group import TrainerGroup, WeightSyncError, push_weights
from hpref.runfolder.heartbeat import clear_heartbeat, write_heartbeat
from hpref.runfolder.layout import CHECKPOINTS, RL_EXECUTOR, ROLLOUT_PREFIX
from hpref.runfolder.save_trigger import check_save_trigger
from hpref.runtime.ray_cluster import actor_death

HEARTBEAT_INTERVAL_S = 5.0  # well under HEARTBEAT_STALE_S: a slow rollout does not read as a hung run


@dataclass
class Handles:
    """Actor handles (Ray or `LocalActor`), each called as `await h.method.remote(...)`; a policy's
    trainer is its `TrainerGroup` (a bare handle is taken as a group of one rank)."""

    executor: Any
    engines: dict[str, Any]
    trainers: dict[str, TrainerGroup]

    def __post_init__(self) -> None:
        self.trainers = {
            p: t if isinstance(t, TrainerGroup) else TrainerGroup(p, [t]) for p, t in self.trainers.items()
        }


@dataclass
class DriveResult:
    positions: dict[str, int]  # each policy's next rollout id when the run ended
    saves: int
    debug_exit: bool
    evals: list[dict[str, Any]] = field(default_factory=list)  # each: rollout + RolloutExecutor.evaluate
    seconds: float = 0.0  # the policies' loops alone: no actor start-up, no restore
    timed_out: bool = False  # the leader ended at `time_limit_s`, before `num_rollouts`
    stopped_by: str | None = None  # SIGTERM or SIGINT: the leader saved and ended at that rollout
    last_save: str | None = None  # this run's newest save (`checkpoints/rollout-*`), if it made one
    #: the judged matches of every rollout taken so far (`Rollout.standings`): the live table's
    standings: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def leaderboard(self, policies: list[str]) -> dict[str, float]:
        """Bradley-Terry (Elo-scale) ratings of the policies and their starting checkpoints
        (`<id>@start`, fixed players: their answers never change) from the run's judged matches
        (debate verdicts, online DPO's cross-policy pairs) and the last eval's battles; {} with
        neither."""
        from hpref.rl.report.leaderboard import bradley_terry, table_battles

        battles = table_battles(self.standings)
        if self.evals:
            battles += self.evals[-1].get("leaderboard_battles") or []
        if not battles:
            return {}
        players = list(policies)
        for a, b, *_ in battles:
            players.extend(x for x in (a, b) if x not in players)
        return bradley_terry(players, battles)


async def save_all(
    handles: Handles,
    order: list[str],
    positions: dict[str, int],
    run_dir: Path,
    leader: str,
    keep_last: int = 0,
) -> CheckpointRecord:
    """Every trainer, then the executor, then — only after all of them saved — the record."""
    rel = f"{CHECKPOINTS}/{ROLLOUT_PREFIX}{positions[leader]:06d}"
    folder = run_dir / rel
    await asyncio.gather(*(handles.trainers[p].save(str(folder / p)) for p in order))
    await handles.executor.save.remote(str(folder / RL_EXECUTOR))
    record = CheckpointRecord(leader, {p: positions[p] for p in order}, save_dir=rel)
    write_record(run_dir, record)
    logger.info(f"saved {rel}: " + ", ".join(f"{p} at rollout {positions[p]}" for p in order))
    if keep_last:
        prune_checkpoints(run_dir, keep_last, record)
    return record


def prune_checkpoints(run_dir: Path, keep_last: int, record: CheckpointRecord) -> list[str]:
    """Delete all but the newest `keep_last` saves under `checkpoints/`; returns what was deleted.

    Runs only after the record is written, and never deletes the folder the record points to (even
    if it is not among the newest, e.g. after a resume from an older save into the same folder):
    that is the one save a resume can use. Half-written saves of an interrupted run (no record names
    them) are older than the record's and go with the rest.
    """
    import shutil

    root = run_dir / CHECKPOINTS
    keep = {Path(record.save_dir).name}
    saves = sorted(p for p in root.glob(f"{ROLLOUT_PREFIX}*") if p.is_dir())
    keep.update(p.name for p in saves[-keep_last:])
    deleted = []
    for folder in saves:
        if folder.name not in keep:
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(folder.name)
    if deleted:
        logger.info(f"keep_last = {keep_last}: deleted {', '.join(deleted)}")
    return deleted


class Driver:
    """One run's policy loops and the state they share: where each policy stands (`positions`), the
    run's result so far, the leader's two parkers (saves, evals), the stop event and each policy's KL
    since the last eval. `lead` is the leader's loop, `follow(p)` a follower's, each made of `step(p)`
    (one rollout trained, its weights pushed when due, its metrics row written) and, for the leader,
    `after_rollout` (the eval and save that are due, and whether the run ends); `run` starts the loops
    and the heartbeat and ends them all when the first one fails or the leader ends."""

    def __init__(
        self,
        config: RLConfig,
        order: list[str],
        handles: Handles,
        run_dir: Path,
        starts: dict[str, int],
        metrics: MetricsWriter | None = None,
        signals: StopSignals | None = None,
    ) -> None:
        self.config, self.order, self.handles, self.run_dir = config, order, handles, run_dir
        self.leader, self.followers = order[0], order[1:]
        self.metrics = metrics or MetricsWriter(None)
        #: the command's SIGTERM / SIGINT handlers, asked after each leader rollout
        self.signals = signals
        self.save_parker, self.eval_parker = Parker(self.followers, "save"), Parker(self.followers, "eval")
        self.positions = dict(starts)
        self.stop = asyncio.Event()
        self.result = DriveResult(self.positions, saves=0, debug_exit=False)
        self.began = time.perf_counter()
        self.bucket_bytes = sync_bucket_bytes(config)
        self.sleeps = {p: colocated(config, p) for p in order}
        # each policy's KL to its start in the rollouts since the last eval (a trainer measures it when
        # kl_coef > 0 or measure_kl): the eval's KL, beside its answer lengths and scores
        self.kl_since_eval: dict[str, list[float]] = {p: [] for p in order}
        #: the policies that play the environment's episodes together (`rl.environment.roles`): they
        #: take each rollout in lockstep, none a rollout ahead of another (`ahead`)
        self.together = seated_policies(config, order)
        #: episodes of several turns (any environment but `single-turn`): a push waits for those in flight
        self.episodes = config.environment.name != "single-turn"
        #: the policies whose trainer learned since its engine last got its weights
        self.unpushed: set[str] = set()
        #: the policies between a rollout's training and the end of its push (`ahead`: partners wait)
        self.pushing: set[str] = set()

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    async def step(self, p: str) -> None:
        """Policy `p`'s next rollout: fetched, trained (its engine asleep meanwhile when colocated),
        its weights pushed every `update_weights_interval` rollouts, its metrics row written."""
        r = self.positions[p]
        rollout = await self.handles.executor.get.remote(r, p)
        learns = self.config.learns(p, r, self.order)
        stats: dict[str, float] = {}
        if learns:  # else it acts frozen: `train = false`, or not its turn in `[rl.schedule]`
            if self.sleeps[p] and self.episodes:  # a prefetched episode's next turns need it awake
                await self.handles.executor.settle.remote(p)
            async with self.engine_asleep(p):
                stats = await self.handles.trainers[p].train(rollout)
            self.unpushed.add(p)
        self.pushing.add(p)
        self.positions[p] = r + 1
        version = None
        try:
            due = self.positions[p] % self.config.update_weights_interval == 0
            # a policy whose turn to learn ends pushes what it learned before it acts frozen
            ending = not self.config.learns(p, r + 1, self.order)
            if p in self.unpushed and (due or ending):
                if self.episodes:  # a prefetched episode's turns all come from the weights it began on
                    await self.handles.executor.settle.remote(p)
                trainer, engine = self.handles.trainers[p], self.handles.engines[p]
                version = await push_weights(trainer, engine, p, self.bucket_bytes)
                self.unpushed.discard(p)
        finally:
            self.pushing.discard(p)
            # the rollout trained, and a save may count it, even when its push failed (no version)
            row = rollout_metrics(rollout, stats, version)
            if not learns:
                row["learned"] = False
            if "kl" in stats:
                self.kl_since_eval[p].append(float(stats["kl"]))
            row["elapsed_s"] = self.elapsed()  # for "reached X within N minutes"
            self.metrics.write(p, row)
            if rollout.matches:  # the live table: refitted on every rollout that adds a match
                self.result.standings = rollout.standings or {}
                self.metrics.log_leaderboard(self.result.leaderboard(self.order), r)

    @contextlib.asynccontextmanager
    async def engine_asleep(self, p: str) -> AsyncIterator[None]:
        """Colocated (`rl.colocate`): the engine gives the GPU up while its trainer steps; a shared
        base's engine while any of its policies steps (the first to step puts it to sleep, the last
        wakes it). Otherwise nothing."""
        if not self.sleeps[p]:
            yield
            return
        base = self.handles.trainers[p].base
        base.stepping += 1
        if base.stepping == 1:
            await self.handles.engines[p].sleep.remote()
        try:
            yield
        finally:
            base.stepping -= 1
            if base.stepping == 0:
                await self.handles.engines[p].wake.remote()

    async def evaluate(self) -> None:
        """Every policy's eval (the followers parked by the caller): one row per policy, the answers
        under the leader's rollout, the KL since the last eval averaged into it."""
        leader_at = self.positions[self.leader]
        evaluation = await self.handles.executor.evaluate.remote(self.order)
        self.metrics.write_answers(f"{ROLLOUT_PREFIX}{leader_at:06d}", evaluation.pop("answers", {}))
        evaluation["rollout"] = leader_at
        evaluation["kl"] = {p: sum(k) / len(k) for p, k in self.kl_since_eval.items() if k}
        self.result.evals.append(evaluation)
        for p in self.order:
            row = eval_row(evaluation, p)
            row.update(rollout=self.positions[p], elapsed_s=self.elapsed())
            self.metrics.write(p, row)
            self.kl_since_eval[p].clear()
        logger.info("eval: " + "; ".join(eval_line(evaluation, p) for p in self.order))

    def out_of_time(self) -> bool:
        limit = self.config.time_limit_s
        return limit is not None and self.elapsed() >= limit

    async def lead(self) -> None:
        """The leader's loop: `num_rollouts` rollouts (fewer when something ends the run), each followed
        by what is due (`after_rollout`); the followers stop where the last save recorded them."""
        while self.positions[self.leader] < self.config.num_rollouts:
            while self.ahead(self.leader) and not self.stop.is_set():
                await asyncio.sleep(LOCKSTEP_POLL_S)
            await self.step(self.leader)
            if await self.after_rollout():
                break
        self.stop.set()

    async def after_rollout(self) -> bool:
        """After a leader rollout: the eval and the global save that are due, with the followers
        parked; True when the run ends here (the last rollout, `debug_exit_after_rollout`, a signal,
        `time_limit_s`)."""
        config, r = self.config, self.positions[self.leader]
        timed_out = self.out_of_time()
        last = r >= config.num_rollouts or timed_out
        debug = config.debug_exit_after_rollout == r
        # the leader alone reads (and removes) the trigger of `hpref save --now`: one save, not one
        # per policy, at this rollout boundary, through the usual global save
        asked = check_save_trigger(self.run_dir)
        if asked:
            logger.info(f"hpref save --now: a global save after leader rollout {r}")
        # SIGTERM or Ctrl-C: the save `hpref save --now` would make, then the end (no eval: the
        # stop is bounded by rl.stop_timeout_s, and a scheduler's grace period is short)
        signalled = self.signals is not None and self.signals.requested
        if config.eval_interval and (r % config.eval_interval == 0 or last) and not signalled:
            async with self.eval_parker.hold(config.park_timeout):
                await self.evaluate()
        due = bool(config.save_interval) and r % config.save_interval == 0
        if due or last or debug or asked or signalled:
            await self.save(stopping=last or debug or signalled)
        if signalled:
            assert self.signals is not None and self.signals.first is not None
            self.result.stopped_by = self.signals.first.name
        elif debug:
            self.result.debug_exit = True
            logger.info(f"debug_exit_after_rollout = {r}: stopping after the save")
        elif timed_out:
            self.result.timed_out = True
            logger.info(f"time_limit_s = {config.time_limit_s:g} reached after leader rollout {r}")
        return signalled or debug or timed_out

    async def save(self, stopping: bool) -> None:
        """A global save with the followers parked; `stopping`: the stop is set before they are
        released, so they stop where the save recorded them."""
        async with self.save_parker.hold(self.config.park_timeout):
            saved = await save_all(
                self.handles, self.order, self.positions, self.run_dir, self.leader, self.config.keep_last
            )
            self.result.saves += 1
            self.result.last_save = saved.save_dir
            if stopping:
                self.stop.set()

    async def follow(self, p: str) -> None:
        """A follower's loop: a rollout at a time until the leader ends, parking whenever the leader
        holds a save or an eval."""
        try:
            while not self.stop.is_set():
                await self.save_parker.park(p)
                await self.eval_parker.park(p)
                if self.stop.is_set():
                    break
                if self.ahead(p):  # back to the parkers: the leader may be holding them meanwhile
                    await asyncio.sleep(LOCKSTEP_POLL_S)
                    continue
                await self.step(p)
        finally:
            self.save_parker.leave(p)
            self.eval_parker.leave(p)

    def ahead(self, p: str) -> bool:
        """Whether `p` plays episodes together with a policy that has not yet taken `p`'s last
        rollout, or whose push is still under way: their episodes are shared, so each rollout's are
        trained on by all of them at the same weights (a policy running ahead would make its
        partners' part of them stale; a rollout `p` starts mid-push would meet a partner's weights
        before or after it, as timing has it, and a resumed run would not replay it)."""
        mine = self.positions[p]
        return p in self.together and any(
            self.positions[q] < mine or q in self.pushing for q in self.together if q != p
        )

    async def beat(self) -> None:
        """The run's liveness for `hpref save --now` (hpref.runfolder.heartbeat), from the event loop
        itself: a loop that stops turning stops beating."""
        while True:
            write_heartbeat(self.run_dir, self.positions[self.leader])
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def run(self) -> DriveResult:
        """Every policy's loop and the heartbeat until the leader ends or a loop fails (its error is
        the run's: the other loops are cancelled)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # from here a first signal waits for the leader's next rollout boundary and its save; once the
        # loops have ended, signals are only noted (the teardown ahead must reach every actor)
        with self.signals.graceful() if self.signals is not None else contextlib.nullcontext():
            heartbeat = asyncio.ensure_future(self.beat())
            tasks = {asyncio.ensure_future(self.lead()): self.leader}
            tasks.update({asyncio.ensure_future(self.follow(p)): p for p in self.followers})
            try:
                await first_failure(tasks)
            finally:
                self.stop.set()
                for task in tasks:
                    task.cancel()
                heartbeat.cancel()
                await asyncio.gather(*tasks, heartbeat, return_exceptions=True)
                clear_heartbeat(self.run_dir)
        self.result.seconds = self.elapsed()
        return self.result


#: how often a policy that is a rollout ahead of its partners looks again (an asyncio sleep: cheap)
LOCKSTEP_POLL_S = 0.01


def seated_policies(config: RLConfig, order: list[str]) -> frozenset[str]:
    """The run's policies that play its environment's episodes together (none when each plays its
    own: `hpref.rl.environments.registry.seated_roles`)."""
    from hpref.rl.environments.registry import build_environment, seated_roles

    seated = seated_roles(config, build_environment(config), order, "recipe")
    return frozenset(seated.values()) if seated else frozenset()


async def first_failure(tasks: dict[asyncio.Future[None], str]) -> None:
    """Wait for every task; the first that fails raises its error here (named in the log unless it
    is a lost actor or a failed weight update, which run_rl names with where to resume from)."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = task.exception()
            if exc is not None:
                if actor_death(exc) is None and not isinstance(exc, WeightSyncError):
                    logger.error(f"policy '{tasks[task]}' failed: {type(exc).__name__}: {exc}")
                raise exc


async def drive(
    config: RLConfig,
    order: list[str],
    handles: Handles,
    run_dir: Path,
    starts: dict[str, int],
    metrics: MetricsWriter | None = None,
    signals: StopSignals | None = None,
) -> DriveResult:
    """Run every policy's loop until the leader ends (see the module docstring and `Driver`).
    `signals`: the command's SIGTERM / SIGINT handlers, asked after each leader rollout."""
    return await Driver(config, order, handles, run_dir, starts, metrics, signals).run()


def sync_bucket_bytes(config: RLConfig) -> int:
    return int(config.weight_sync_bucket_mb * 2**20)


async def restore(
    handles: Handles, order: list[str], source: Path | None, bucket_bytes: int = 256 << 20
) -> tuple[dict[str, int], CheckpointRecord | None]:
    """Load every part from the record in `source` (None: fresh), check them, push restored weights."""
    leader = order[0]
    record = read_record(source) if source is not None else None
    if record is None:
        starts = {p: 0 for p in order}
        check_resume(None, leader, starts)
        return starts, None
    assert source is not None
    folder = source / record.save_dir
    loaded = await asyncio.gather(*(handles.trainers[p].load(str(folder / p)) for p in order))
    starts = dict(zip(order, loaded, strict=True))
    executor_positions = await handles.executor.load.remote(str(folder / RL_EXECUTOR))
    check_resume(record, leader, starts, executor_positions)
    await asyncio.gather(
        *(push_weights(handles.trainers[p], handles.engines[p], p, bucket_bytes) for p in order if starts[p])
    )
    logger.info(f"resumed from {folder}: " + ", ".join(f"{p} at rollout {starts[p]}" for p in order))
    return starts, record
