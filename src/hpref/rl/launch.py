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
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from hpref.builtin.loggers import build_loggers
from hpref.builtin.rewards import check_reward_exports
from hpref.errors import RecipeError, UserError
from hpref.logs import ACTOR_LOG_DIR_ENV
from hpref.recipe.rl import RLConfig, resolve_engine
from hpref.recipe.rl_rewards import reward_parts, rl_rewards
from hpref.rl.algorithms.registry import check_algorithms
from hpref.rl.control.driver import DriveResult, Handles, drive, restore, sync_bucket_bytes
from hpref.rl.control.record import ResumeError, check_record_leader, read_record
from hpref.rl.control.stop import StopNow, StopSignals, stopped_line
from hpref.rl.report.metrics import MetricsWriter, eval_line
from hpref.rl.trainer.backends import check_backends, trainer_backend
from hpref.rl.trainer.group import WeightSyncError
from hpref.runfolder.files import write_json_atomic
from hpref.runfolder.layout import RECORD_FILE, RL_JSON, RL_SUMMARY
from hpref.runtime.ray_cluster import actor_death, actor_names, connect_ray, dead_actor, lost_actor, ray_cause

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hpref.recipe import Recipe
    from hpref.rl.protocols import PromptSource

CLOSE_TIMEOUT_S = 30.0  # how long teardown waits for an actor's own close() before killing it
FORWARDED_ENV = (
    "HPREF_CACHE", "HPREF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "HF_HOME", ACTOR_LOG_DIR_ENV
)  # fmt: skip


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


def create_ray_actors(
    config: RLConfig,
    order: list[str],
    teardown: Teardown,
    prompts: PromptSource | None = None,
    where: str = "recipe",
) -> Handles:
    """The cluster checked and each policy's placement group reserved (`hpref.rl.placement.resources`: a run
    the cluster cannot hold is refused in one line before any actor starts), then engines, the
    executor and the trainer ranks, each in its bundle and registered for teardown as it is created.
    `prompts`: the built `[rl.prompts]` source (None: the executor builds it)."""
    import ray

    from hpref.rl.engines.host import EngineHost
    from hpref.rl.placement.resources import EXECUTOR_CPUS, check_cluster, cluster_nodes, colocated, reserve
    from hpref.rl.placement.shared_base import AdapterEngine, SharedBase, placement_order, resolve_share_base
    from hpref.rl.rollout.executor import RolloutExecutor
    from hpref.rl.trainer.actor import TrainerActor
    from hpref.rl.trainer.group import TrainerGroup

    engine_config = config.engine_config
    if engine_config is None:
        engine_config = resolve_engine(config.engine)
        config = config.model_copy(update={"engine_config": engine_config})
    if config.share_base is None:  # a caller that skipped `preflight`
        config = resolve_share_base(config, order, where)
    # with a shared base, the leader's engine and trainer group serve every policy
    hosts = placement_order(config, order)
    check_cluster(config, hosts, ray.cluster_resources(), where, nodes=cluster_nodes())
    placement = reserve(config, hosts, where=where)
    teardown.add("placement groups", placement.release)
    opts = {"num_cpus": EXECUTOR_CPUS}  # outside the policies' groups (it serves them all)
    env = _actor_env()

    def kill(handle: ActorHandle) -> Callable[[], None]:
        return lambda: ray.kill(handle, no_restart=True)

    adapters = {p: config.policies[p].lora for p in order} if config.share_base else None
    engines: dict[str, Any] = {}
    for p in hosts:
        # a colocated engine waits for its trainer's step in a second thread (`EngineHost.sleep`)
        threads = {"max_concurrency": 2} if colocated(config, p) else {}
        engines[p] = (
            ray.remote(EngineHost)
            .options(**placement.engine_options(p), **threads)
            .remote(
                config.engine.name, engine_config, p, config.policies[p].model, env=env, adapters=adapters
            )
        )
        teardown.add(f"engine '{p}'" + (" (shared base)" if adapters else ""), kill(engines[p]))
    if adapters:
        engines = {p: engines[hosts[0]] for p in order}  # the executor batches on the one engine
    executor = (
        ray.remote(RolloutExecutor).options(**opts).remote(config, order, engines, env=env, prompts=prompts)
    )
    teardown.add("rollout executor", kill(executor))
    trainers = {}
    shared = {p: config.policies[p] for p in order} if config.share_base else None
    for p in hosts:
        policy = config.policies[p]
        # a megatron trainer's parallel state is closed before the kill; a group's ranks are only
        # killed (a rank left waiting in a collective for a dead peer would not answer `close`, and
        # its process group ends with its process)
        closes = trainer_backend(policy.trainer_backend).holds_process_state
        ranks = []
        for rank in range(policy.ranks):
            handle = (
                ray.remote(TrainerActor)
                .options(**placement.rank_options(p, rank))
                .remote(
                    p,
                    policy,
                    config.update_weights_interval,
                    env=env,
                    rank=rank,
                    world_size=policy.ranks,
                    shared=shared,
                    threads=policy.threads,
                )
            )
            name = f"trainer '{p}'" + (f" rank {rank}" if policy.ranks > 1 else "")
            teardown.add(name, close_then_kill(handle) if closes else kill(handle))
            ranks.append(handle)
        trainers[p] = TrainerGroup(p, ranks)
    if shared:  # one group of ranks and one engine, seen by each policy as its own
        base, ranks = SharedBase(), trainers[hosts[0]].ranks
        trainers = {p: TrainerGroup(p, ranks, base) for p in order}
        engines = {p: AdapterEngine(engines[p], p) for p in order}
    return Handles(executor, engines, trainers)


def close_then_kill(handle: ActorHandle) -> Callable[[], None]:
    """A teardown step that asks the actor to `close()` (bounded wait; a dead or stuck actor is
    only logged) and then kills it."""
    import ray

    def step() -> None:
        try:
            ray.get(handle.close.remote(), timeout=CLOSE_TIMEOUT_S)
        except Exception as exc:  # the kill below still ends it
            logger.debug(f"close before kill: {exc}")
        ray.kill(handle, no_restart=True)

    return step


def check_rewards_fit_prompts(config: RLConfig, prompts: PromptSource, where: str) -> None:
    """Each reward can score these prompts, one line naming its key: the `rule` reward's built-in
    utility is the synthetic arena's judge (on other prompts it would score nonsense, so it needs
    prompts with a ground truth or a user `function`); a user function takes (prompt, answer) or
    (prompt, answer, row); the prompt file has the `columns` a reward reads from its rows."""
    from hpref.builtin.rewards import rule_function

    scorer = [("rl.eval_scorer", config.eval_scorer, config.eval_scorer_config)] if config.eval_scorer else []
    parts = [(p.key, p.section, p.config) for p in reward_parts(config)]
    available = tuple(getattr(prompts, "columns", ()))
    for key, section, validated in parts + scorer:
        function = getattr(validated, "function", None)
        if section.name == "rule" and function is None and not prompts.ground_truth:
            raise RecipeError(
                f"{where}: {key}.name: 'rule' scores with the synthetic arena's judge, which knows nothing "
                f"of the prompts from {prompts.source}; use a 'judge' (path = an `hpref save` export) or set "
                f"{key}.function = 'module:function'"
            )
        takes_row = False
        if section.name == "rule" and function is not None:
            try:
                _fn, takes_row = rule_function(function, key)
            except UserError as exc:
                raise RecipeError(f"{where}: {exc}") from None
        wanted = list(getattr(validated, "columns", None) or ())
        if wanted and not takes_row:
            raise RecipeError(
                f"{where}: {key}.columns: the function {function!r} takes (prompt, answer), so it never "
                "sees a row; give it a third parameter, row, or drop columns"
            )
        missing = [c for c in wanted if c not in available]
        if missing:
            raise RecipeError(
                f"{where}: {key}.columns: {', '.join(map(repr, missing))} not in the prompts from "
                f"{prompts.source} (its columns beside the conversation: {', '.join(available) or 'none'})"
            )


def _rl_config(recipe: Recipe) -> tuple[RLConfig, Path]:
    """The typed `[rl]` section of a Recipe (`hpref.recipe.rl`: validated once, when the recipe
    loaded, with the recipe's `[lora]` as every policy's default) and its run folder."""
    if recipe.rl is None:
        where = str(getattr(recipe, "_source", None) or "recipe")
        raise RecipeError(f"{where}: rl: the recipe has no [rl] section")
    return recipe.rl, Path(recipe.run.run_dir)


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


def preflight(recipe: Recipe, policies: list[str]) -> PromptSource:
    """Everything `hpref rl` checks before it writes anything or starts an actor, each mistake one
    line naming the key: adapters that fit their LM, megatron policies, policy folders that hold a
    causal LM with a chat template, the warm-up's data file, reward exports, and the prompt file,
    which is read here. Returns
    the built `[rl.prompts]` source."""
    from hpref.rl.policy import check_policy_models
    from hpref.rl.rollout.executor import build_prompt_source

    config, _run_dir = _rl_config(recipe)
    order = config.select(list(policies))
    where = str(getattr(recipe, "_source", None) or "recipe")
    if any(config.policies[p].lora is not None for p in order):
        from hpref.rl.policy import check_policy_lora

        # a wrong target name is one line here, not an actor that dies while it is being built
        check_policy_lora(config, order, where)
    check_backends(config, order, where)  # e.g. megatron-core there, and an architecture it maps
    check_algorithms(config, order, where)  # e.g. online DPO's pairs: an even group, a judging reward
    check_policy_models(config, order, where)
    from hpref.rl.warmup.data import check_source

    check_source(config.warmup, where)  # its file and columns; its rows are read when it trains
    # an engine may refuse policies it cannot run (vLLM: head sizes its kernels lack)
    engine = config.engine_config or resolve_engine(config.engine, where)
    engine_check = getattr(engine, "check_policies", None)
    if engine_check is not None:
        engine_check(config, order, where)
    check_reward_exports(rl_rewards(config), where)
    prompts = build_prompt_source(config)
    check_rewards_fit_prompts(config, prompts, where)
    from hpref.rl.placement.shared_base import resolve_share_base

    # decided here, once, for the policies that run: the actors, rl.json and the plan read it
    recipe.rl = resolve_share_base(config, order, where)
    return prompts


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
    config, run_dir = _rl_config(recipe)
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
    from hpref.rl.policy import policy_tokenizer

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
        },
        indent=2,
    )
    if len(order) > 1:
        from hpref.rl.placement.shared_base import share_base_line, share_base_problem

        # on the console when the policies could share (the default then depends on the device), in
        # the log file only when they cannot (full fine-tuning, other bases)
        level = "INFO" if share_base_problem(config, order) is None else "DEBUG"
        logger.log(level, share_base_line(config))
    setup_s = time.perf_counter() - started

    teardown = Teardown()
    if connect_ray(ray_address):
        import ray

        teardown.add("ray", ray.shutdown)
    actors: dict[str, str] = {}
    metrics = MetricsWriter(run_dir)
    try:
        where = str(getattr(recipe, "_source", None) or "recipe")
        handles = create_ray_actors(config, order, teardown, prompts, where)
        actors = actor_names(handles)
        teardown_executor = handles.executor

        async def main() -> DriveResult:
            try:
                # the trainer groups of ranks > 1 form their process groups and shard their policies
                await asyncio.gather(*(handles.trainers[p].start() for p in order))
                if config.eval_interval:  # before restore: the engines still serve the start
                    start = await handles.executor.record_start.remote(order)
                    metrics.write_answers("start", start.pop("answers", {}))
                    if start:
                        logger.info("start: " + "; ".join(eval_line(start, f"{p}@start") for p in order))
                starts, _record = await restore(handles, order, source, sync_bucket_bytes(config))
                for p in order:
                    metrics.truncate(p, starts[p])
                # TensorBoard, W&B, ...: the leader writes, each curve continued from its policy's start
                first = min(starts.values()) if source is not None and starts else None
                metrics.loggers = build_loggers(recipe, run_dir, None if first is None else first - 1)
                for p in order:
                    if first is not None:
                        metrics.replay(p, first)
                return await drive(config, order, handles, run_dir, starts, metrics, signals)
            finally:
                try:  # stop prefetching; a dead executor must not mask the run's own error
                    await asyncio.shield(teardown_executor.shutdown.remote())
                except Exception as exc:
                    logger.debug(f"rollout executor shutdown: {exc}")

        result = asyncio.run(main())
    except StopNow as stop:
        teardown.close()  # every actor and the cluster first: the line is the run's last word
        metrics.close()
        logger.warning(stopped_line(run_dir, stop))
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
        if lost is None and actors:  # a failed weight push: a trainer or engine that died under it?
            lost = dead_actor(handles, actors)
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
        logger.error(f"{what}; the run stopped; {where}")
        metrics.close()  # the loggers' files complete up to the last row
        return 1
    finally:
        if signals is not None:
            signals.closing()  # a signal during the teardown must not cut it short
        teardown.close()
    leaderboard = result.leaderboard(order)
    metrics.log_leaderboard(leaderboard, result.positions.get(order[0], 0))  # at the leader's end
    metrics.close()
    leaderboard_by = result.evals[-1].get("leaderboard_by") if result.evals else None
    if not leaderboard:
        if result.evals:
            why = (
                "the last eval's answers had no pointwise scores (no ground truth, no [rl.eval_scorer], a "
                "pairwise reward)"
            )
        elif config.eval_interval:
            why = f"no eval ran (the run stopped before rollout {config.eval_interval}, the first eval)"
        else:
            why = "no eval ran (eval_interval = 0)"
        logger.info(f"no leaderboard in {RL_SUMMARY}: {why}")
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
            "leaderboard": leaderboard,  # {} when no eval ran or nothing scored pointwise
            "leaderboard_by": leaderboard_by,  # "ground truth", "eval scorer", "reward" or None
            "warmup_checkpoints": warm_started,
            "setup_s": setup_s,  # tokenizers and warm-ups (cached after the first run)
            "drive_s": result.seconds,  # the policies' loops: what concurrency speeds up
            "wall_s": time.perf_counter() - started,
        },
        indent=2,
        sort_keys=True,
    )
    from hpref.rl.report.leaderboard import plot_metrics

    plot_metrics(run_dir, order)
    if result.stopped_by is not None:
        leader = order[0]
        logger.warning(
            stopped_line(run_dir, result.stopped_by, rollout=result.positions[leader], saved=result.last_save)
        )
        assert signals is not None and signals.exit_code is not None
        return signals.exit_code
    return 0
