"""Which process runs each policy's engine (`rl.engines_in_executor`): a Ray actor of its own, or a
thread of the rollout executor's process; and which runs the rollout executor
(`rl.executor_in_driver`): a Ray actor of its own, or the `hpref rl` process itself.

An engine actor is a process that imports torch, transformers and its model classes before it
generates a token: ~4.3 CPU-seconds on the 2-core CPU of docs/getting-started.md, for a tiny model as
for SmolLM2, and a few hundred MiB of resident memory that holds no weights. The rollout executor,
which calls the engines for every rollout, already runs; an engine hosted there costs its model and
nothing else, and the executor's calls reach it without a trip through Ray. The driver and the
trainer groups still call it as an actor (`hpref.rl.engines.host.HostedEngine`), so nothing else
changes: parking, weight syncs, versions, saves and resume are the same code.

    config = resolve_engine_process(config)          # engines_in_executor True or False from here on
    engine_process_line(config)                      # what `--plan` and the run's log say

Unset, engines go into the executor when their component can run there (`hostable`: the
transformers engine; a vLLM engine keeps its own process, its GPU and its worker processes) and
they run on CPU: a GPU engine wants a device and a process of its own. The executor's Ray CPUs then
include the hosted engines' (`executor_cpus`), so what the cluster check and the placement reserve
is unchanged in sum.

The executor with the engines it hosts then comes into the driver too, unless the recipe says
otherwise: its actor was one more process of the same imports (~5 CPU-seconds), and every call
the driver made to it a trip through Ray. In the driver it is the object it was in its actor,
its coroutines run on the driver's event loop and each engine in its thread
(`hpref.rl.engines.host.InDriverExecutor`); Ray then reserves nothing for it (its CPUs and memory
are the driver's node's, outside the cluster's count). Engine actors (vLLM, GPUs) keep an executor
actor, which Ray places beside them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpref.errors import RecipeError

if TYPE_CHECKING:
    from hpref.recipe.rl import RLConfig

#: Why an unset `engines_in_executor` is on for CPU engines (benchmarks/README.md, "Engines in the
#: rollout executor"): the process and its imports are saved, the generation is not slowed.
HOSTED_REASON = (
    "the engines run on CPU, where an engine's own process costs ~4.3 CPU-s of imports and a few hundred "
    "MiB before its first token; in the rollout executor's process each engine still generates in a "
    "thread of its own; rl.engines_in_executor = false gives each engine an actor (a multi-node CPU "
    "cluster: to spread them)"
)


#: Why an unset `executor_in_driver` is on when the engines are in the executor.
IN_DRIVER_REASON = (
    "the engines are in the rollout executor (CPU engines): in the hpref rl process it saves the executor's "
    "own process (~5 CPU-s of imports and a few hundred MiB) and a trip through Ray for each of its calls; "
    "rl.executor_in_driver = false gives it an actor"
)


def engine_process_decision(config: RLConfig) -> tuple[bool, str]:
    """(in the executor, reason) for `config`'s engines: as the recipe says, or (unset) in the
    executor when the engine component can be hosted there and runs on CPU."""
    from hpref.rl.placement.resources import engine_config, engines_on_gpu

    engine = engine_config(config)
    name = config.engine.name
    if config.engines_in_executor is not None:
        said = "true" if config.engines_in_executor else "false"
        return bool(config.engines_in_executor), f"set in the recipe (rl.engines_in_executor = {said})"
    if not getattr(engine, "hostable", False):  # a plugin engine says so, or keeps its own process
        return False, f"the {name!r} engine runs in a process of its own (it is not hostable)"
    if engines_on_gpu(config):
        return False, "the engines run on GPUs, each in an actor process of its own"
    return True, HOSTED_REASON


def executor_process_decision(config: RLConfig) -> tuple[bool, str]:
    """(in the driver, reason) for the rollout executor of `config`, whose engines are decided: as
    the recipe says, or (unset) in the driver exactly when the engines are in the executor."""
    if config.executor_in_driver is not None:
        said = "true" if config.executor_in_driver else "false"
        return bool(config.executor_in_driver), f"set in the recipe (rl.executor_in_driver = {said})"
    if config.engines_in_executor:
        return True, IN_DRIVER_REASON
    return False, "the engines are actors of their own; the executor is one too, placed by Ray"


def resolve_engine_process(config: RLConfig, where: str = "recipe") -> RLConfig:
    """`config` with `engines_in_executor` and `executor_in_driver` decided (`engine_process_decision`,
    `executor_process_decision`) and the reasons kept; `engines_in_executor = true` for an engine that
    cannot be hosted, or on a GPU, and `executor_in_driver = true` with engine actors, are one
    `RecipeError` line each."""
    if config.engines_in_executor_reason is not None and config.executor_in_driver_reason is not None:
        return config
    from hpref.rl.placement.resources import engine_config, engines_on_gpu

    if config.engines_in_executor:
        if not getattr(engine_config(config), "hostable", False):
            raise RecipeError(
                f"{where}: rl.engines_in_executor = true, but the {config.engine.name!r} engine cannot run "
                "in the rollout executor's process (set it to false)"
            )
        if engines_on_gpu(config):
            raise RecipeError(
                f"{where}: rl.engines_in_executor = true, but the engines ask for GPUs "
                "(rl.engine.num_gpus); a GPU engine runs in an actor of its own (set it to false)"
            )
    hosted, reason = engine_process_decision(config)
    if config.executor_in_driver and not hosted:
        raise RecipeError(
            f"{where}: rl.executor_in_driver = true, but the engines run in actors of their own "
            "(rl.engines_in_executor = false, a vLLM or a GPU engine): the executor comes into the driver "
            "only with the engines it hosts (set it to false)"
        )
    config = config.model_copy(update={"engines_in_executor": hosted, "engines_in_executor_reason": reason})
    in_driver, why = executor_process_decision(config)
    return config.model_copy(update={"executor_in_driver": in_driver, "executor_in_driver_reason": why})


def engine_process_line(config: RLConfig) -> str:
    """What a decided `config` says of its engines' processes (the plan, the run's log)."""
    where = "in the rollout executor's process" if config.engines_in_executor else "in actors of their own"
    return f"engines_in_executor = {'true' if config.engines_in_executor else 'false'} ({where}): " + str(
        config.engines_in_executor_reason
    )


def executor_process_line(config: RLConfig) -> str:
    """What a decided `config` says of its rollout executor's process (the plan, the run's log)."""
    where = "in the hpref rl process" if config.executor_in_driver else "in an actor of its own"
    return f"executor_in_driver = {'true' if config.executor_in_driver else 'false'} ({where}): " + str(
        config.executor_in_driver_reason
    )
