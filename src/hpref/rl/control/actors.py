"""A run's Ray actors: each policy's placement group reserved (the cluster checked first), then the
engines, the rollout executor and the trainer ranks, each registered for teardown as it is created,
and torn down in reverse (`Teardown`), also when a policy fails or a signal stops the run. Engines
in the rollout executor's process (`rl.engines_in_executor`) are built by the executor from their
`EngineSpec`s and die with it.

    teardown = Teardown()
    handles = create_ray_actors(config, order, teardown, prompts, where)   # Handles for the driver
    ...
    teardown.close()
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from loguru import logger

from hpref.logs import ACTOR_LOG_DIR_ENV
from hpref.recipe.rl import RLConfig, resolve_engine
from hpref.rl.control.driver import Handles
from hpref.rl.trainer.backends import trainer_backend

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hpref.rl.placement.resources import Reservation
    from hpref.rl.protocols import PromptSource
    from hpref.rl.rollout.executor import RolloutExecutor
    from hpref.rl.trainer.group import TrainerGroup

CLOSE_TIMEOUT_S = 30.0  # how long teardown waits for an actor's own close() before killing it
FORWARDED_ENV = (
    "HPREF_CACHE", "HPREF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "HF_HOME", ACTOR_LOG_DIR_ENV,
    "HPREF_AUTO_PRECISION",  # hpref.models.precision.PIN_ENV: a pinned `auto` holds in every actor
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


def actor_env() -> dict[str, str]:
    """The driver's cache, offline and log-folder variables, handed to every actor."""
    return {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}


def create_ray_actors(
    config: RLConfig,
    order: list[str],
    teardown: Teardown,
    prompts: PromptSource | None = None,
    where: str = "recipe",
) -> Handles:
    """The cluster checked and each policy's placement group reserved (`hpref.rl.placement.resources`:
    a run the cluster cannot hold is refused in one line before any actor starts), then engines, the
    executor and the trainer ranks, each in its bundle and registered for teardown as it is created.
    `prompts`: the built `[rl.prompts]` source (None: the executor builds it)."""
    import ray

    from hpref.rl.engines.host import HostedEngine
    from hpref.rl.placement.engine_process import resolve_engine_process
    from hpref.rl.placement.resources import check_cluster, cluster_nodes, executor_cpus, reserve
    from hpref.rl.placement.shared_base import placement_order, resolve_share_base
    from hpref.rl.rollout.executor import RolloutExecutor
    from hpref.rl.trainer.group import TrainerGroup

    if config.engine_config is None:
        config = config.model_copy(update={"engine_config": resolve_engine(config.engine)})
    if config.share_base is None:  # a caller that skipped `preflight`
        config = resolve_share_base(config, order, where)
    config = resolve_engine_process(config, where)
    # with a shared base, the leader's engine and trainer group serve every policy
    hosts = placement_order(config, order)
    check_cluster(config, hosts, ray.cluster_resources(), where, nodes=cluster_nodes())
    placement = reserve(config, hosts, where=where)
    teardown.add("placement groups", placement.release)
    if config.executor_in_driver:  # the executor and its engines in this process (the trainers first:
        # their processes start while this one builds the engines)
        trainers = {
            p: TrainerGroup(p, start_trainer_ranks(config, order, p, placement, teardown)) for p in hosts
        }
        executor = InDriverExecutor(
            RolloutExecutor(config, order, engine_specs(config, order, hosts), prompts=prompts, hosted=True)
        )
        teardown.add("rollout executor (in this process, with its engines)", executor.stop)
        return _views(config, order, hosts, executor, executor.engines, trainers)
    if config.engines_in_executor:  # built by the executor, in its process
        engines = engine_specs(config, order, hosts)
    else:
        engines = start_engines(config, order, hosts, placement, teardown)
    opts = {"num_cpus": executor_cpus(config, hosts)}  # outside the policies' groups (it serves them all)
    executor = (
        ray.remote(RolloutExecutor)
        .options(**opts)
        .remote(config, order, engines, env=actor_env(), prompts=prompts, hosted=config.engines_in_executor)
    )
    hosting = " (and the engines it hosts)" if config.engines_in_executor else ""
    teardown.add("rollout executor" + hosting, kill(executor))
    if config.engines_in_executor:  # the driver's and trainers' handles reach them through it
        hosted = {h: HostedEngine(executor, h) for h in hosts}  # a shared base's: one for all
        engines = {p: hosted[p if p in hosted else hosts[0]] for p in order}
    trainers = {p: TrainerGroup(p, start_trainer_ranks(config, order, p, placement, teardown)) for p in hosts}
    return _views(config, order, hosts, executor, engines, trainers)


def _views(
    config: RLConfig,
    order: list[str],
    hosts: list[str],
    executor: Any,
    engines: dict[str, Any],
    trainers: dict[str, TrainerGroup],
) -> Handles:
    """The driver's handles; with a shared base, one group of ranks and one engine seen by each
    policy as its own."""
    from hpref.rl.placement.shared_base import AdapterEngine, SharedBase
    from hpref.rl.trainer.group import TrainerGroup

    if config.share_base:
        base, ranks = SharedBase(), trainers[hosts[0]].ranks
        trainers = {p: TrainerGroup(p, ranks, base) for p in order}
        engines = {p: AdapterEngine(engines[p], p) for p in order}
    return Handles(executor, engines, trainers)


class _Call:
    """`method.remote(...)` of an `InDriverExecutor`: the call started now on the running event loop
    (a coroutine method as a task, as a Ray call is sent when made) and awaited as an ObjectRef is."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        result = self._method(*args, **kwargs)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        done = asyncio.get_running_loop().create_future()
        done.set_result(result)
        return done


class InDriverExecutor:
    """The rollout executor in the driver's process (`rl.executor_in_driver`), called as its actor
    was: `await executor.get.remote(r, p)`. Its coroutines run on the driver's event loop, where the
    drive awaits them (on its actor they ran on the actor's loop: the same interleaving of one
    thread's coroutines); its engines each run in a thread of their own (`InProcessEngine`), its
    rewards' forward passes in threads too (`asyncio.to_thread`), so the loop is never held by a
    model. It is no Ray actor: nothing for Ray to place, kill or name (`_actor_id` is absent)."""

    def __init__(self, executor: RolloutExecutor) -> None:
        self.executor = executor
        #: each policy's engine (a shared base's: one for all), called directly, not through Ray
        self.engines = executor.engines

    def __getattr__(self, name: str) -> _Call:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Call(getattr(self.executor, name))

    def stop(self) -> None:
        """Teardown: the engines take no more calls (a generation in flight ends in its thread)."""
        for engine in {id(e): e for e in self.engines.values()}.values():
            engine.stop_thread()


def engine_specs(config: RLConfig, order: list[str], hosts: list[str]) -> dict[str, Any]:
    """Per policy, the `EngineSpec` the rollout executor builds its engine from
    (`rl.engines_in_executor`); with a shared base every policy's is the leader's one engine."""
    from hpref.rl.engines.host import EngineSpec

    adapters = {p: config.policies[p].lora for p in order} if config.share_base else None
    specs = {
        p: EngineSpec(config.engine.name, config.engine_config, p, config.policies[p].model, adapters)
        for p in hosts
    }
    return {p: specs[p if p in specs else hosts[0]] for p in order}


def start_engines(
    config: RLConfig, order: list[str], hosts: list[str], placement: Reservation, teardown: Teardown
) -> dict[str, Any]:
    """An `EngineHost` per hosting policy in its placement group; with a shared base the one engine
    serves every policy (the executor batches on it)."""
    import ray

    from hpref.rl.engines.host import EngineHost
    from hpref.rl.placement.resources import colocated

    adapters = {p: config.policies[p].lora for p in order} if config.share_base else None
    engines: dict[str, Any] = {}
    for p in hosts:
        # a colocated engine waits for its trainer's step in a second thread (`EngineHost.sleep`)
        threads = {"max_concurrency": 2} if colocated(config, p) else {}
        engines[p] = (
            ray.remote(EngineHost)
            .options(**placement.engine_options(p), **threads)
            .remote(
                config.engine.name,
                config.engine_config,
                p,
                config.policies[p].model,
                env=actor_env(),
                adapters=adapters,
            )
        )
        teardown.add(f"engine '{p}'" + (" (shared base)" if adapters else ""), kill(engines[p]))
    if adapters:
        engines = {p: engines[hosts[0]] for p in order}
    return engines


def start_trainer_ranks(
    config: RLConfig, order: list[str], p: str, placement: Reservation, teardown: Teardown
) -> list[ActorHandle]:
    """Policy `p`'s `ranks` trainer actors, each in its bundle (with a shared base, `p` hosts every
    policy's adapter)."""
    import ray

    from hpref.rl.trainer.actor import TrainerActor

    policy = config.policies[p]
    shared = {q: config.policies[q] for q in order} if config.share_base else None
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
                env=actor_env(),
                rank=rank,
                world_size=policy.ranks,
                shared=shared,
                threads=policy.threads,
            )
        )
        name = f"trainer '{p}'" + (f" rank {rank}" if policy.ranks > 1 else "")
        teardown.add(name, close_then_kill(handle) if closes else kill(handle))
        ranks.append(handle)
    return ranks


def kill(handle: ActorHandle) -> Callable[[], None]:
    """A teardown step that kills the actor (no restart)."""
    import ray

    return lambda: ray.kill(handle, no_restart=True)


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
