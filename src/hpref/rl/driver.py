"""The driver of `hpref rl`: one asyncio task per policy, coordinated by the leader.

    run_rl(recipe, ["a", "b"], ray_address=None, resume=None)

- Components are created in a fixed order (engines, rollout executor, trainers) and torn down in
  reverse, also when a policy fails or the user presses Ctrl-C.
- The leader (the first policy named) runs `num_rollouts` rollouts; followers run until it ends.
  The first task to fail ends the run, and its error is the run's error.
- Every `save_interval` leader rollouts (and at the end, at `debug_exit_after_rollout`, and when
  `<run_dir>/SAVE_NOW` appears) the leader parks every follower, saves every trainer and then the
  executor, writes `record.json`, and releases them. Evals park through a separate parker.
- Weights go from trainer to engine every `update_weights_interval` rollouts of that policy.

The driver only coordinates: numbers come from `hpref.rl.algorithms` (inside the trainers), the
resume rules from `hpref.rl.record`, the rendezvous from `hpref.rl.parking`.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from hpref.errors import UserError
from hpref.rl.config import RLConfig, parse_rl_section
from hpref.rl.parking import Parker
from hpref.rl.record import (
    CheckpointRecord,
    ResumeError,
    check_record_leader,
    check_resume,
    read_record,
    write_record,
)
from hpref.runfolder.files import write_json_atomic

SAVE_NOW_FILE = "SAVE_NOW"
ACTOR_CPUS = 0.25  # actors mostly wait on each other; fractions let a 2-core machine hold them all
FORWARDED_ENV = ("HPREF_CACHE", "HPREF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "HF_HOME")


@dataclass
class Handles:
    """Actor handles (Ray or `LocalActor`), each called as `await h.method.remote(...)`."""

    executor: Any
    engines: dict[str, Any]
    trainers: dict[str, Any]


@dataclass
class DriveResult:
    positions: dict[str, int]  # each policy's next rollout id when the run ended
    saves: int
    debug_exit: bool
    evals: list[dict[str, Any]] = field(default_factory=list)  # each: rollout, true_utility, battles
    seconds: float = 0.0  # the policies' loops alone: no actor start-up, no restore
    timed_out: bool = False  # the leader ended at `time_limit_s`, before `num_rollouts`

    def leaderboard(self, policies: list[str]) -> dict[str, float]:
        """Bradley-Terry (Elo-scale) ratings of the policies and their starting checkpoints
        (`<id>@start`) from the last eval's battles; {} without evals."""
        from hpref.rl.leaderboard import bradley_terry

        if not self.evals or not self.evals[-1]["battles"]:
            return {}
        battles = self.evals[-1]["battles"]
        players = list(policies)
        for a, b, _score in battles:
            players.extend(x for x in (a, b) if x not in players)
        return bradley_terry(players, battles)


class MetricsWriter:
    """`<run_dir>/metrics/<policy>.jsonl`, one JSON object per line, appended (resumes continue it)."""

    def __init__(self, run_dir: Path | None) -> None:
        self.folder = None if run_dir is None else run_dir / "metrics"
        self.rows: dict[str, list[dict[str, Any]]] = {}

    def truncate(self, policy: str, start: int) -> int:
        """Drop rows of rollouts at or after `start` (written after the save a resume starts from,
        so they would be counted twice); returns how many were dropped."""
        if self.folder is None or not (self.folder / f"{policy}.jsonl").is_file():
            return 0
        path = self.folder / f"{policy}.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if keep_row(json.loads(line), start)]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
        return len(lines) - len(kept)

    def write(self, policy: str, row: dict[str, Any]) -> None:
        self.rows.setdefault(policy, []).append(row)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f"{policy}.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row, sort_keys=True) + "\n")


def keep_row(row: dict[str, Any], start: int) -> bool:
    """Whether a metrics row survives a resume at `start`: training rows of earlier rollouts, and
    eval rows taken at or before the resumed position."""
    return row["rollout"] <= start if row.get("eval") else row["rollout"] < start


def rollout_metrics(rollout: dict[str, Any], stats: dict[str, float], version: int | None) -> dict[str, Any]:
    """The metrics row of one policy's rollout: reward and true utility, throughput, versions."""
    rewards = rollout["rewards"]
    mean = sum(rewards) / len(rewards)
    row: dict[str, Any] = {
        "rollout": rollout["rollout_id"],
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        "data_version": rollout["version"],
        "weight_version": version,
        "gen_tokens": rollout["tokens"],
        "gen_tokens_per_s": rollout["tokens"] / max(rollout["seconds"], 1e-9),
        "opponent_tokens": rollout.get("opponent_tokens", 0),
        "stale_regenerated": bool(rollout.get("stale_regenerated", False)),
    }
    truth = rollout.get("true_utility")
    if truth:
        row["true_utility"] = sum(truth) / len(truth)
    row.update(stats)
    return row


async def push_weights(trainer: Any, engine: Any) -> int:
    """Trainer -> engine in begin/load/commit steps; an interrupted transfer is aborted, so the
    engine keeps serving its previous version rather than a half-loaded one."""
    version, state = await trainer.update_weights.remote()
    await engine.begin_update.remote(version)
    try:
        await engine.load_weights.remote(state)
        return await engine.commit_update.remote()
    except BaseException:
        await asyncio.shield(engine.abort_update.remote())
        raise


async def save_all(
    handles: Handles,
    order: list[str],
    positions: dict[str, int],
    run_dir: Path,
    leader: str,
    keep_last: int = 0,
) -> CheckpointRecord:
    """Every trainer, then the executor, then — only after all of them saved — the record."""
    rel = f"checkpoints/rollout-{positions[leader]:06d}"
    folder = run_dir / rel
    await asyncio.gather(*(handles.trainers[p].save.remote(str(folder / p)) for p in order))
    await handles.executor.save.remote(str(folder / "executor"))
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

    root = run_dir / "checkpoints"
    keep = {Path(record.save_dir).name}
    saves = sorted(p for p in root.glob("rollout-*") if p.is_dir())
    keep.update(p.name for p in saves[-keep_last:])
    deleted = []
    for folder in saves:
        if folder.name not in keep:
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(folder.name)
    if deleted:
        logger.info(f"keep_last = {keep_last}: deleted {', '.join(deleted)}")
    return deleted


async def drive(
    config: RLConfig,
    order: list[str],
    handles: Handles,
    run_dir: Path,
    starts: dict[str, int],
    metrics: MetricsWriter | None = None,
) -> DriveResult:
    """Run every policy's loop until the leader ends (see the module docstring)."""
    leader, followers = order[0], order[1:]
    save_parker, eval_parker = Parker(followers, "save"), Parker(followers, "eval")
    positions = dict(starts)
    stop = asyncio.Event()
    metrics = metrics or MetricsWriter(None)
    result = DriveResult(positions, saves=0, debug_exit=False)
    began = time.perf_counter()

    async def step(p: str) -> None:
        r = positions[p]
        rollout = await handles.executor.get.remote(r, p)
        stats = await handles.trainers[p].train.remote(rollout)
        positions[p] = r + 1
        version = None
        if positions[p] % config.update_weights_interval == 0:
            version = await push_weights(handles.trainers[p], handles.engines[p])
        row = rollout_metrics(rollout, stats, version)
        row["elapsed_s"] = time.perf_counter() - began  # for "reached X within N minutes"
        metrics.write(p, row)

    async def evaluate() -> None:
        evaluation = await handles.executor.evaluate.remote(order)
        evaluation["rollout"] = positions[leader]
        result.evals.append(evaluation)
        scores = evaluation["true_utility"]
        win_rates = evaluation.get("win_rate_vs_start", {})
        for p in order:
            if p not in scores:
                continue
            row = {
                "eval": True,
                "rollout": positions[p],
                "eval_true_utility": scores[p],
                "elapsed_s": time.perf_counter() - began,
            }
            if p in win_rates:
                row["eval_win_rate_vs_start"] = win_rates[p]
            if f"{p}@start" in scores:
                row["eval_start_true_utility"] = scores[f"{p}@start"]
            metrics.write(p, row)
        logger.info(
            "eval: "
            + ", ".join(
                f"{p} true utility {scores[p]:.3f}"
                + (f", win rate vs start {win_rates[p]:.3f}" if p in win_rates else "")
                for p in order
                if p in scores
            )
        )

    def out_of_time() -> bool:
        limit = config.time_limit_s
        return limit is not None and time.perf_counter() - began >= limit

    async def run_leader() -> None:
        while positions[leader] < config.num_rollouts:
            await step(leader)
            r = positions[leader]
            timed_out = out_of_time()
            last = r >= config.num_rollouts or timed_out
            debug = config.debug_exit_after_rollout == r
            trigger = run_dir / SAVE_NOW_FILE
            asked = trigger.exists()  # the leader alone reads the trigger: one save, not one per policy
            if config.eval_interval and (r % config.eval_interval == 0 or last):
                async with eval_parker.hold(config.park_timeout):
                    await evaluate()
            if (config.save_interval and r % config.save_interval == 0) or last or debug or asked:
                async with save_parker.hold(config.park_timeout):
                    await save_all(handles, order, positions, run_dir, leader, config.keep_last)
                    result.saves += 1
                    if asked:
                        trigger.unlink(missing_ok=True)
                    if last or debug:
                        stop.set()  # set before release: followers stop where the save recorded them
            if debug:
                result.debug_exit = True
                logger.info(f"debug_exit_after_rollout = {r}: stopping after the save")
                break
            if timed_out:
                result.timed_out = True
                logger.info(f"time_limit_s = {config.time_limit_s:g} reached after leader rollout {r}")
                break
        stop.set()

    async def run_follower(p: str) -> None:
        try:
            while not stop.is_set():
                await save_parker.park(p)
                await eval_parker.park(p)
                if stop.is_set():
                    break
                await step(p)
        finally:
            save_parker.leave(p)
            eval_parker.leave(p)

    tasks = {asyncio.ensure_future(run_leader()): leader}
    tasks.update({asyncio.ensure_future(run_follower(p)): p for p in followers})
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    if _death(exc) is None:  # a lost actor is named by run_rl, whose loop met it is noise
                        logger.error(f"policy '{tasks[task]}' failed: {type(exc).__name__}: {exc}")
                    raise exc
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    result.seconds = time.perf_counter() - began
    return result


async def restore(
    handles: Handles, order: list[str], source: Path | None
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
    loaded = await asyncio.gather(*(handles.trainers[p].load.remote(str(folder / p)) for p in order))
    starts = dict(zip(order, loaded, strict=True))
    executor_positions = await handles.executor.load.remote(str(folder / "executor"))
    check_resume(record, leader, starts, executor_positions)
    await asyncio.gather(*(push_weights(handles.trainers[p], handles.engines[p]) for p in order if starts[p]))
    logger.info(f"resumed from {folder}: " + ", ".join(f"{p} at rollout {starts[p]}" for p in order))
    return starts, record


# --------------------------------------------------------------------------------------------------
# Ray shell


class Teardown:
    """Callbacks run in reverse order of registration; each failure is logged, none stops the rest."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], Any]]] = []

    def add(self, name: str, fn: Callable[[], Any]) -> None:
        self._steps.append((name, fn))

    def close(self) -> list[str]:
        done = []
        while self._steps:
            name, fn = self._steps.pop()
            try:
                fn()
            except Exception as exc:  # teardown must reach every component
                logger.warning(f"teardown of {name} failed: {exc}")
            done.append(name)
        return done


def _actor_env() -> dict[str, str]:
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


def create_ray_actors(config: RLConfig, order: list[str], teardown: Teardown) -> Handles:
    """Engines, then the executor, then trainers; each registered for teardown as it is created."""
    import ray

    from hpref.rl.actors import EngineHost, RolloutExecutor, TrainerActor

    opts = {"num_cpus": ACTOR_CPUS}
    env = _actor_env()

    def kill(handle: Any) -> Callable[[], None]:
        return lambda: ray.kill(handle, no_restart=True)

    engine_config = config.engine_config
    if engine_config is None:
        from hpref.rl.config import resolve_engine

        engine_config = resolve_engine(config.engine)
    engine_opts = {
        "num_cpus": float(getattr(engine_config, "num_cpus", ACTOR_CPUS)),
        "num_gpus": float(getattr(engine_config, "num_gpus", 0)),
    }
    engines = {}
    for p in order:
        engines[p] = (
            ray.remote(EngineHost)
            .options(**engine_opts)
            .remote(config.engine.name, engine_config, p, config.policies[p].model, env=env)
        )
        teardown.add(f"engine '{p}'", kill(engines[p]))
    executor = ray.remote(RolloutExecutor).options(**opts).remote(config, order, engines, env=env)
    teardown.add("rollout executor", kill(executor))
    trainers = {}
    for p in order:
        trainers[p] = (
            ray.remote(TrainerActor)
            .options(**opts)
            .remote(p, config.policies[p], config.update_weights_interval, env=env)
        )
        teardown.add(f"trainer '{p}'", kill(trainers[p]))
    return Handles(executor, engines, trainers)


def _rl_config(recipe: Any) -> tuple[RLConfig, Path]:
    """The parsed `[rl]` section and the run folder of a Recipe (or of an already parsed RLConfig)."""
    run_dir = Path(recipe.run.run_dir)
    rl = recipe.rl
    if isinstance(rl, RLConfig):
        return rl, run_dir
    where = str(getattr(recipe, "_source", None) or "recipe")
    return parse_rl_section(rl, where, lora=getattr(recipe, "lora", None)), run_dir


def resume_source(run_dir: Path, resume: str | None) -> Path | None:
    """Where to restore from: None (fresh), the run folder (`auto`), or a given run folder.

    A fresh start refuses a run folder that already holds a record: it would silently mix two runs'
    checkpoints and metrics.
    """
    if resume is None:
        if read_record(run_dir) is not None:
            raise ResumeError(
                f"{run_dir} already holds a checkpoint record: pass --resume auto to continue it, "
                "or set run.name to start another run"
            )
        return None
    if resume == "auto":
        return run_dir if read_record(run_dir) is not None else None
    source = Path(resume)
    if read_record(source) is None:
        raise ResumeError(f"--resume {resume}: no record.json there")
    return source


def apply_warmup(config: RLConfig, order: list[str]) -> dict[str, str]:
    """Point every policy without `model.path` at its warm-up checkpoint (trained now or cached).

    Returns {policy: checkpoint folder}. Without `[rl.warmup]` policies keep their model settings.
    The folders are content-addressed by the model and warm-up settings, so a resumed run starts
    from exactly the checkpoint its first run started from.
    """
    if config.warmup is None:
        return {}
    from hpref.rl.warmup import warmup_checkpoint

    out = {}
    for p in order:
        model = config.policies[p].model
        if model.path is not None:
            continue
        folder = warmup_checkpoint(model, config.warmup)
        config.policies[p].model = model.model_copy(update={"path": str(folder)})
        out[p] = str(folder)
    return out


def run_rl(
    recipe: Any, policies: list[str], ray_address: str | None = None, resume: str | None = None
) -> int:
    """`hpref rl`: train `policies` (the first is the leader) as the recipe's `[rl]` section says.

    `ray_address`: an existing cluster (`ray start --head`); None starts a local one (or reuses the
    Ray session already initialised in this process). `resume`: None, `auto` or a run folder.
    Returns the exit code (0; 130 after Ctrl-C). User mistakes raise `UserError`.
    """
    started = time.perf_counter()
    config, run_dir = _rl_config(recipe)
    order = config.select(list(policies))
    if any(config.policies[p].lora is not None for p in order):
        from hpref.rl.actors import check_policy_lora

        # a wrong target name is one line here, not an actor that dies while it is being built
        check_policy_lora(config, order, str(getattr(recipe, "_source", None) or "recipe"))
    source = resume_source(run_dir, resume)
    if source is not None:
        record = read_record(source)
        assert record is not None
        check_record_leader(record, order[0], order)
    run_dir.mkdir(parents=True, exist_ok=True)
    from hpref.rl.actors import policy_tokenizer

    for p in order:  # train/cache tokenizers once here, not once per actor in parallel
        policy_tokenizer(config.policies[p].model)
    warm_started = apply_warmup(config, order)
    write_json_atomic(
        run_dir / "rl.json",
        {"policies": order, "warmup_checkpoints": warm_started, "config": config.model_dump(mode="json")},
        indent=2,
    )
    setup_s = time.perf_counter() - started

    teardown = Teardown()
    if connect_ray(ray_address):
        import ray

        teardown.add("ray", ray.shutdown)
    actors: dict[str, str] = {}
    try:
        handles = create_ray_actors(config, order, teardown)
        actors = actor_names(handles)
        teardown_executor = handles.executor
        metrics = MetricsWriter(run_dir)

        async def main() -> DriveResult:
            try:
                if config.eval_interval:  # before restore: the engines still serve the start
                    start_utility = await handles.executor.record_start.remote(order)
                    if start_utility:
                        logger.info(
                            "start: "
                            + ", ".join(f"{p} true utility {u:.3f}" for p, u in start_utility.items())
                        )
                starts, _record = await restore(handles, order, source)
                for p in order:
                    metrics.truncate(p, starts[p])
                return await drive(config, order, handles, run_dir, starts, metrics)
            finally:
                try:  # stop prefetching; a dead executor must not mask the run's own error
                    await asyncio.shield(teardown_executor.shutdown.remote())
                except Exception as exc:
                    logger.debug(f"rollout executor shutdown: {exc}")

        result = asyncio.run(main())
    except KeyboardInterrupt:
        logger.warning("interrupted: tearing every component down")
        return 130
    except UserError:
        raise
    except Exception as exc:
        cause = _ray_cause(exc)
        if isinstance(cause, UserError):
            raise cause from None
        lost = lost_actor(exc, actors)
        if lost is None:
            raise
        record = read_record(run_dir)
        where = (
            f"--resume auto continues from {record.save_dir} ({run_dir / 'record.json'})"
            if record is not None
            else "no save was recorded yet, so a new run starts from the beginning"
        )
        logger.opt(exception=exc).debug("actor lost")
        logger.error(f"{lost} died ({type(_death(exc)).__name__}); the run stopped; {where}")
        return 1
    finally:
        teardown.close()
    write_json_atomic(
        run_dir / "rl_summary.json",
        {
            "positions": result.positions,
            "saves": result.saves,
            "debug_exit": result.debug_exit,
            "timed_out": result.timed_out,
            "evals": [{k: v for k, v in e.items() if k != "battles"} for e in result.evals],
            "leaderboard": result.leaderboard(order),
            "warmup_checkpoints": warm_started,
            "setup_s": setup_s,  # tokenizers and warm-ups (cached after the first run)
            "drive_s": result.seconds,  # the policies' loops: what concurrency speeds up
            "wall_s": time.perf_counter() - started,
        },
        indent=2,
        sort_keys=True,
    )
    from hpref.rl.leaderboard import plot_metrics

    plot_metrics(run_dir, order)
    return 0


def _ray_cause(exc: BaseException) -> BaseException:
    """The user's error inside a Ray task error (Ray wraps the actor's exception)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def actor_names(handles: Handles) -> dict[str, str]:
    """Ray actor id (hex) -> what it is, for naming an actor that died."""
    names = {}
    for p, engine in handles.engines.items():
        names[engine._actor_id.hex()] = f"policy '{p}': engine actor"
    for p, trainer in handles.trainers.items():
        names[trainer._actor_id.hex()] = f"policy '{p}': trainer actor"
    names[handles.executor._actor_id.hex()] = "the rollout executor actor (shared by all policies)"
    return names


def _death(exc: BaseException | None) -> BaseException | None:
    """The `RayActorError` (a dead or unreachable actor) in `exc`'s chain of Ray wrappers, if any.

    The innermost one is the actor that actually died: an engine killed under the executor reaches
    the driver as the executor's task error wrapping the engine's death.
    """
    from ray.exceptions import RayActorError

    found = None
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RayActorError) and getattr(exc, "actor_id", None):
            found = exc
        cause = getattr(exc, "cause", None)
        exc = cause if isinstance(cause, BaseException) else exc.__cause__
    return found


def lost_actor(exc: BaseException, names: dict[str, str]) -> str | None:
    """`policy 'b': trainer actor` when `exc` says one of this run's actors died, else None."""
    death = _death(exc)
    if death is None:
        return None
    return names.get(death.actor_id, f"Ray actor {death.actor_id}")


# --------------------------------------------------------------------------------------------------
# Connecting to Ray

#: Ray resolves a node address of 127.0.0.1 to the machine's network address (so that other nodes
#: could reach it) unless this is 0, and its GCS, raylet and workers listen on every interface
#: unless the node address is exactly 127.0.0.1. One switch gives a cluster that listens on loopback.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@contextmanager
def _loopback_ray():
    """Ray on this node addressed (and listening) as 127.0.0.1, for a `ray.init` in the block.

    The switch is read from the environment when Ray's constants are first imported, and the GCS
    and raylet this process starts inherit it; a Ray imported before us has read it already, so its
    constant is set for the block too.
    """
    import ray._private.ray_constants as ray_constants

    old_env, old_flag = os.environ.get(RAY_LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[RAY_LOOPBACK_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(RAY_LOOPBACK_ENV, None)
        else:
            os.environ[RAY_LOOPBACK_ENV] = old_env


@contextmanager
def _stderr_to_log():
    """File descriptor 2 into the debug log for the block.

    Ray's C++ client retries a refused token or a missing head once a second for ~20 s and warns on
    the process's stderr each time, before Python logging is set up (RAY_BACKEND_LOG_LEVEL does not
    reach it): twenty lines ahead of the one that says what is wrong.
    """
    import sys
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace").strip()
            if text:
                logger.debug(f"ray.init said:\n{text}")


def connect_ray(address: str | None) -> bool:
    """Start a local Ray cluster listening on loopback only, or join the one at `address`.

    Returns whether this call connected (False: Ray was already initialised in this process, whose
    owner shuts it down). Joining: a cluster started with token authentication (Ray's default when
    `~/.ray/auth_token` exists) gets the token Ray finds (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`,
    `~/.ray/auth_token`); Ray itself only does this for address "auto". A loopback address is joined
    as a loopback node, which is what a head started on loopback (README) expects. A cluster that
    cannot be reached, or refuses the token, is a `UserError`.
    """
    import ray

    if ray.is_initialized():
        return False
    if not address:
        with _loopback_ray():
            ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False)
        return True
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise UserError(
            f"--ray-address {address}: expected HOST:PORT of a Ray head (ray start --head --port)"
        )
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as exc:
        raise UserError(
            f"--ray-address {address}: no Ray cluster answers there ({exc.strerror or exc}); start one "
            "with `ray start --head` (see README) or leave --ray-address out for a local one"
        ) from None
    try:
        with _stderr_to_log():
            maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
            if host in LOOPBACK_HOSTS:
                with _loopback_ray():
                    ray.init(address=address, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ray.exceptions.AuthenticationError) as exc:
        raise UserError(
            f"--ray-address {address}: could not join the Ray cluster: {str(exc).splitlines()[0]}; "
            "if it uses token authentication, give this process the same token (RAY_AUTH_TOKEN or "
            "~/.ray/auth_token); a head on this machine must be started as the README says "
            "(its node address 127.0.0.1)"
        ) from None
    return True
