"""`run_rl`: one `hpref rl` run on Ray, from the typed `[rl]` section to `rl_summary.json`.

    run_rl(recipe, ["a", "b"], ray_address=None, resume=None)

The Ray shell around the driver (`hpref.rl.control.driver.drive`): the resume source and its checks, the
policies' tokenizers and warm-ups, `rl.json`, the cluster (`hpref.runtime.ray_cluster`), the actors
(engines, rollout executor, trainers; created in that order and torn down in reverse, also when a
policy fails or a signal stops the run), the restore, the drive, and the run's summary. An actor
that dies is named in one line with where `--resume auto` would continue from, and so is a stop by
SIGTERM or Ctrl-C (`hpref.rl.control.stop`: a save first, unless a second signal stops it at once).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from hpref.builtin.loggers import build_loggers
from hpref.errors import UserError
from hpref.recipe.rl import RLConfig
from hpref.rl.control.actors import Teardown, create_ray_actors
from hpref.rl.control.driver import DriveResult, Handles, drive, restore, sync_bucket_bytes
from hpref.rl.control.preflight import preflight, rl_config
from hpref.rl.control.record import ResumeError, check_record_leader, read_record
from hpref.rl.control.stop import StopNow, StopSignals, stopped_line
from hpref.rl.report.metrics import MetricsWriter, eval_line
from hpref.rl.trainer.group import WeightSyncError
from hpref.runfolder.files import write_json_atomic
from hpref.runfolder.layout import RECORD_FILE, RL_JSON, RL_SUMMARY
from hpref.runtime.ray_cluster import actor_death, actor_names, connect_ray, dead_actor, lost_actor, ray_cause

if TYPE_CHECKING:
    from hpref.recipe import Recipe
    from hpref.rl.protocols import PromptSource


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
    """Point every policy that starts from a warm-up (tiny ones on the synthetic arena's answers,
    every one on `[rl.warmup] path`'s: `hpref.rl.warmup.supervised.warmup_settings`) at its checkpoint
    (trained now or cached).

    Returns {policy: checkpoint folder}. Without `[rl.warmup]` policies keep their model settings.
    The folders are content-addressed by the model, adapter and warm-up settings (and the data
    file's bytes), so a resumed run starts from exactly the checkpoint its first run started from.
    """
    if config.warmup is None:
        return {}
    from hpref.rl.warmup.supervised import warmup_checkpoint, warmup_settings

    out = {}
    for p, (model, lora) in warmup_settings(config, order).items():
        folder = warmup_checkpoint(model, config.warmup, lora=lora)
        config.policies[p].model = model.model_copy(update={"path": str(folder), "name": None})
        out[p] = str(folder)
    return out


@dataclass
class RunSetup:
    """What `prepare` settled before any actor starts: the typed `[rl]` section (warm-ups applied,
    `share_base` decided), the policies in order (the leader first), the run folder, the save a
    resume restores (None: fresh), the prompt source and the warm-up checkpoints."""

    config: RLConfig
    order: list[str]
    run_dir: Path
    source: Path | None
    prompts: PromptSource
    warm_started: dict[str, str]
    where: str


def run_rl(
    recipe: Recipe,
    policies: list[str],
    ray_address: str | None = None,
    resume: str | None = None,
    prompts: PromptSource | None = None,
    signals: StopSignals | None = None,
) -> int:
    """`hpref rl`: train `policies` (the first is the leader) as the recipe's `[rl]` section says.

    `ray_address`: an existing cluster (`ray start --head`); None starts a local one (or reuses the
    Ray session already initialised in this process). `resume`: None, `auto` or a run folder.
    `prompts`: what `preflight` returned, when the caller ran it (else it runs here). `signals`: the
    command's SIGTERM / SIGINT handlers (`hpref.rl.control.stop`; None: a Ctrl-C tears down, exit 130).
    Returns the exit code (0; 128 + the first signal's number after a stop by a signal: 143 for
    SIGTERM, 130 for SIGINT). User mistakes raise `UserError`.
    """
    started = time.perf_counter()
    setup = prepare(recipe, policies, resume, prompts)
    setup_s = time.perf_counter() - started
    metrics = MetricsWriter(setup.run_dir)
    outcome = run_on_ray(recipe, setup, metrics, ray_address, signals)
    if isinstance(outcome, int):  # stopped at once, interrupted, or an actor lost: already said
        return outcome
    write_summary(setup, outcome, metrics, setup_s=setup_s, wall_s=time.perf_counter() - started)
    if outcome.stopped_by is not None:
        leader = setup.order[0]
        logger.warning(
            stopped_line(
                setup.run_dir, outcome.stopped_by, rollout=outcome.positions[leader], saved=outcome.last_save
            )
        )
        assert signals is not None and signals.exit_code is not None
        return signals.exit_code
    return 0


def prepare(
    recipe: Recipe, policies: list[str], resume: str | None, prompts: PromptSource | None
) -> RunSetup:
    """Everything before the cluster: the checks (`preflight`, unless the caller ran it), the resume
    source and its leader, the tokenizers, the warm-ups, and `rl.json`."""
    config, run_dir = rl_config(recipe)
    order = config.select(list(policies))
    if prompts is None:
        prompts = preflight(recipe, order)
    config = recipe.rl or config  # `preflight` decided `share_base`
    source = resume_source(run_dir, resume)
    if source is not None:
        record = read_record(source)
        assert record is not None
        check_record_leader(record, order[0], order)
    run_dir.mkdir(parents=True, exist_ok=True)
    from hpref.models.causal_lm import policy_tokenizer

    for p in order:  # train/cache tokenizers once here, not once per actor in parallel
        policy_tokenizer(config.policies[p].model)
    warm_started = apply_warmup(config, order)
    # the config's dump says what `share_base` became; why is said beside it (not a recipe key)
    write_json_atomic(
        run_dir / RL_JSON,
        {
            "policies": order,
            "warmup_checkpoints": warm_started,
            "config": config.model_dump(mode="json"),
            "share_base_reason": config.share_base_reason,
            "engines_in_executor_reason": config.engines_in_executor_reason,
            "executor_in_driver_reason": config.executor_in_driver_reason,
        },
        indent=2,
    )
    from hpref.rl.placement.engine_process import engine_process_line, executor_process_line

    logger.debug(engine_process_line(config))
    logger.debug(executor_process_line(config))
    if len(order) > 1:
        from hpref.rl.placement.shared_base import share_base_line, share_base_problem

        # on the console when the policies could share (the default then depends on the device), in
        # the log file only when they cannot (full fine-tuning, other bases)
        level = "INFO" if share_base_problem(config, order) is None else "DEBUG"
        logger.log(level, share_base_line(config))
    where = str(getattr(recipe, "_source", None) or "recipe")
    return RunSetup(config, order, run_dir, source, prompts, warm_started, where)


def run_on_ray(
    recipe: Recipe,
    setup: RunSetup,
    metrics: MetricsWriter,
    ray_address: str | None,
    signals: StopSignals | None,
) -> DriveResult | int:
    """The cluster joined or started, the actors created, then `start_and_drive`; every actor and
    the cluster torn down in reverse, whatever happens. Returns the drive's result, or the exit code
    of a run that ended early: a second signal (128 + its number), Ctrl-C without handlers (130), a
    lost actor or a failed weight update (1, named in one line with where `--resume auto` goes on)."""
    teardown = Teardown()
    if connect_ray(ray_address):
        import ray

        teardown.add("ray", ray.shutdown)
    actors: dict[str, str] = {}
    handles: Handles | None = None
    try:
        handles = create_ray_actors(setup.config, setup.order, teardown, setup.prompts, setup.where)
        actors = actor_names(handles)
        return asyncio.run(start_and_drive(recipe, setup, handles, metrics, signals))
    except StopNow as stop:
        teardown.close()  # every actor and the cluster first: the line is the run's last word
        metrics.close()
        logger.warning(stopped_line(setup.run_dir, stop))
        return stop.exit_code
    except KeyboardInterrupt:
        logger.warning("interrupted: tearing every component down")
        metrics.close()
        return 130
    except UserError:
        raise
    except Exception as exc:
        cause = ray_cause(exc)
        if isinstance(cause, UserError):
            raise cause from None
        lost = lost_actor(exc, actors)
        if lost is None and not isinstance(exc, WeightSyncError):
            raise
        if lost is None and handles is not None and actors:  # a failed push: a part that died under it?
            lost = dead_actor(handles, actors)
        logger.error(stopped_by_failure_line(setup.run_dir, exc, lost))
        metrics.close()  # the loggers' files complete up to the last row
        return 1
    finally:
        if signals is not None:
            signals.closing()  # a signal during the teardown must not cut it short
        teardown.close()


async def start_and_drive(
    recipe: Recipe, setup: RunSetup, handles: Handles, metrics: MetricsWriter, signals: StopSignals | None
) -> DriveResult:
    """The trainer groups started, the start's eval, the restore, the metrics and loggers continued
    from where each policy resumes, then the drive; the executor stops prefetching at the end."""
    config, order, run_dir = setup.config, setup.order, setup.run_dir
    try:
        # the trainer groups of ranks > 1 form their process groups and shard their policies
        await asyncio.gather(*(handles.trainers[p].start() for p in order))
        if config.eval_interval:  # before restore: the engines still serve the start
            start = await handles.executor.record_start.remote(order)
            metrics.write_answers("start", start.pop("answers", {}))
            if start:
                logger.info("start: " + "; ".join(eval_line(start, f"{p}@start") for p in order))
        starts, _record = await restore(handles, order, setup.source, sync_bucket_bytes(config))
        # Ray creates actors in the background: without this wait a fresh run without a start eval
        # would count its engines' start-up (a model load, seconds to minutes) in its first rollout,
        # and the drive's clock (`drive_s`, each row's `elapsed_s`) would not be the loops' alone
        await asyncio.gather(*(handles.engines[p].get_version.remote() for p in order))
        for p in order:
            metrics.truncate(p, starts[p])
        # TensorBoard, W&B, ...: the leader writes, each curve continued from its policy's start
        first = min(starts.values()) if setup.source is not None and starts else None
        metrics.loggers = build_loggers(recipe, run_dir, None if first is None else first - 1)
        for p in order:
            if first is not None:
                metrics.replay(p, first)
        return await drive(config, order, handles, run_dir, starts, metrics, signals)
    finally:
        try:  # stop prefetching; a dead executor must not mask the run's own error
            await asyncio.shield(handles.executor.shutdown.remote())
        except Exception as exc:
            logger.debug(f"rollout executor shutdown: {exc}")


def stopped_by_failure_line(run_dir: Path, exc: BaseException, lost: str | None) -> str:
    """The one line of a run an actor's death (`lost`) or a failed weight update ended, with where
    `--resume auto` continues from."""
    record = read_record(run_dir)
    where = (
        f"--resume auto continues from {record.save_dir} ({run_dir / RECORD_FILE})"
        if record is not None
        else "no save was recorded yet, so a new run starts from the beginning"
    )
    logger.opt(exception=exc).debug("the run stopped")
    death = actor_death(exc)
    how = type(death).__name__ if death is not None else "found dead after a weight update failed"
    what = f"{exc}" if lost is None else f"{lost} died ({how})"
    return f"{what}; the run stopped; {where}"


def write_summary(
    setup: RunSetup, result: DriveResult, metrics: MetricsWriter, *, setup_s: float, wall_s: float
) -> None:
    """After a drive: the leaderboard logged, `rl_summary.json` and the metric plots written."""
    order, run_dir = setup.order, setup.run_dir
    leaderboard = result.leaderboard(order)
    metrics.log_leaderboard(leaderboard, result.positions.get(order[0], 0))  # at the leader's end
    metrics.close()
    if not leaderboard:
        logger.info(f"no leaderboard in {RL_SUMMARY}: {no_leaderboard_reason(setup.config, result)}")
    from hpref.rl.report.metrics import last_rollout_rows

    write_json_atomic(
        run_dir / RL_SUMMARY,
        {
            "positions": result.positions,
            "saves": result.saves,
            "debug_exit": result.debug_exit,
            "timed_out": result.timed_out,
            "stopped_by": result.stopped_by,  # SIGTERM or SIGINT: saved at that rollout and stopped
            "evals": [
                {k: v for k, v in e.items() if k not in ("battles", "leaderboard_battles")}
                for e in result.evals
            ],
            # each policy's last training metrics: rewards (per component), entropy, lengths, clipping
            "last_rollout": last_rollout_rows(run_dir, order),
            "leaderboard": leaderboard,  # {} without judged matches, an eval or pointwise scores
            # the judged matches behind it: {player: {opponent: [games, player's summed score]}}
            "matches": result.standings,
            # "judged matches" (debates, online DPO's cross pairs), then with an eval's battles: "ground
            # truth", "eval scorer" or "reward", joined by " + "; None when the table is empty
            "leaderboard_by": leaderboard_sources(result),
            "warmup_checkpoints": setup.warm_started,
            "setup_s": setup_s,  # tokenizers and warm-ups (cached after the first run)
            "drive_s": result.seconds,  # the policies' loops: what concurrency speeds up
            "wall_s": wall_s,
        },
        indent=2,
        sort_keys=True,
    )
    from hpref.rl.report.leaderboard import plot_metrics

    plot_metrics(run_dir, order)


def leaderboard_sources(result: DriveResult) -> str | None:
    """What the run's leaderboard was fitted to (`DriveResult.leaderboard`), in words."""
    sources = ["judged matches"] if result.standings else []
    if result.evals and result.evals[-1].get("leaderboard_by"):
        sources.append(result.evals[-1]["leaderboard_by"])
    return " + ".join(sources) or None


def no_leaderboard_reason(config: RLConfig, result: DriveResult) -> str:
    if result.evals:
        return (
            "the last eval's answers had no pointwise scores (no ground truth, no [rl.eval_scorer], a "
            "pairwise reward)"
        )
    if config.eval_interval:
        return f"no eval ran (the run stopped before rollout {config.eval_interval}, the first eval)"
    return "no eval ran (eval_interval = 0)"
