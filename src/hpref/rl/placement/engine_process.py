"""Which process runs each policy's engine (`rl.engines_in_executor`): a Ray actor of its own, or a
thread of the rollout executor's process.

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


def resolve_engine_process(config: RLConfig, where: str = "recipe") -> RLConfig:
    """`config` with `engines_in_executor` decided (`engine_process_decision`) and the reason kept;
    `engines_in_executor = true` for an engine that cannot be hosted, or on a GPU, is one
    `RecipeError` line."""
    if config.engines_in_executor is not None and config.engines_in_executor_reason is not None:
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
    return config.model_copy(update={"engines_in_executor": hosted, "engines_in_executor_reason": reason})


def engine_process_line(config: RLConfig) -> str:
    """What a decided `config` says of its engines' processes (the plan, the run's log)."""
    where = "in the rollout executor's process" if config.engines_in_executor else "in actors of their own"
    return f"engines_in_executor = {'true' if config.engines_in_executor else 'false'} ({where}): " + str(
        config.engines_in_executor_reason
    )
