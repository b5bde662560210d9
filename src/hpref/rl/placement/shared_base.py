"""Policies that share one base (`rl.share_base`): one engine and one trainer group for all of them.

When every policy is a LoRA adapter of the same base, the base is held once: one engine serves every
policy's adapter and batches their prompts (`hpref.rl.engines.transformers_engine`,
`hpref.rl.engines.vllm_engine`), one trainer group holds the base and every adapter, each with its own
optimizer, learning rate, clip, KL (the base with adapters off) and rollout settings
(`hpref.rl.trainer.actor`). The driver still sees one engine and one trainer per policy: `AdapterEngine` and a
`TrainerGroup` bound to the policy (`hpref.rl.trainer.group`), so parking, saves, evals, versions and resume
are unchanged.

    config = resolve_share_base(config, order, where)   # share_base True or False from here on
    hosts = placement_order(config, order)              # [leader] when shared: one engine, one group

What a base is, here: the policies' `model` settings, their trainer backend, and what their one
trainer group is made of (`GROUP_KEYS`). Full fine-tuning (no `lora`) and different bases cannot
share; `share_base = true` with either is one line naming the policy and key.

Unset, sharing follows where the engines run (`hpref.rl.placement.resources.engines_on_gpu`, as the placement
asks Ray): on for GPU engines, off for CPU engines, where one shared engine measured slower than two
(`CPU_REASON`). The decision and its reason (`share_base_reason`) are what `hpref rl --plan` prints
and what the run logs and writes to rl.json.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpref.errors import RecipeError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hpref.recipe.rl import RLConfig

#: A policy's settings that make up its trainer group: policies that share one group must agree on them
GROUP_KEYS = (
    "trainer_backend",
    "ranks",
    "cpus_per_rank",
    "gpus_per_rank",
    "threads",
    "reshard_after_forward",
    "precision",
    "activation_checkpointing",
)

#: The engine methods that act on one policy's adapter (`AdapterEngine` adds `adapter=`)
ADAPTER_METHODS = frozenset(
    {
        "generate",
        "begin_update",
        "load_weights",
        "receive_weights",
        "commit_update",
        "abort_update",
        "get_version",
    }
)


def share_base_problem(config: RLConfig, order: Sequence[str]) -> str | None:
    """Why the policies of `order` cannot share one base ("<key>: <reason>"), or None when they can."""
    first = order[0]
    lead = config.policies[first]
    engine = config.engine_config
    if engine is not None and not engine.serves_adapters:
        return f"rl.engine.name: the {config.engine.name!r} engine cannot serve LoRA adapters over one base"
    for p in order:
        policy = config.policies[p]
        if policy.lora is None:
            return (
                f"rl.policies.{p}.lora: policy '{p}' trains every weight (full fine-tuning); only LoRA "
                "adapters of one base can share it"
            )
        if policy.model != lead.model:
            mine, theirs = policy.model.model_dump(), lead.model.model_dump()
            key = next(k for k in mine if mine[k] != theirs[k])
            return (
                f"rl.policies.{p}.model.{key}: policy '{p}' has another base than '{first}' "
                f"({mine[key]!r} vs {theirs[key]!r}); only adapters of the same base can share it"
            )
        for key in GROUP_KEYS:
            if getattr(policy, key) != getattr(lead, key):
                return (
                    f"rl.policies.{p}.{key}: {getattr(policy, key)!r} vs {getattr(lead, key)!r} for "
                    f"'{first}'; policies on one shared trainer group must agree on {', '.join(GROUP_KEYS)}"
                )
    return None


#: Why an unset `share_base` is off when the engines run on CPU (benchmarks/README.md, "LoRA
#: policies on one shared base"): one engine process generates every policy's answers on one core
#: where separate engines use them all, and batching adapters there runs slower, not faster.
CPU_REASON = (
    "the engines run on CPU, where two policies sharing one engine measured 1.64x the wall time of "
    "two apart (134 vs 82 s per leader rollout, python -m benchmarks.rl_shared, 2 cores) for 0.62x "
    "their memory; rl.share_base = true holds the base once anyway"
)
#: Why an unset `share_base` is on when the engines run on GPUs: one engine batches every
#: policy's adapter over one base (vLLM's multi-LoRA), as serving engines are built to.
GPU_REASON = (
    "the engines run on GPUs, where one engine batches every policy's LoRA adapter over one base "
    "(vLLM's multi-LoRA; its speed there is benchmarks/gpu.sh section 6's to measure); "
    "rl.share_base = false gives each policy its own engine"
)


def share_base_decision(config: RLConfig, order: Sequence[str]) -> tuple[bool, str | None, str]:
    """(shared, problem, reason) for the policies of `order`: as the recipe's `share_base` says, or
    (unset) on when there are several policies that can share and their engines run on a GPU.
    `problem`: why they cannot share (`share_base_problem`), None when they can."""
    from hpref.rl.placement.resources import engines_on_gpu

    problem = share_base_problem(config, order) if len(order) > 1 or config.share_base else None
    if config.share_base is not None:
        said = "true" if config.share_base else "false"
        return (
            bool(config.share_base) and problem is None,
            problem,
            f"set in the recipe (rl.share_base = {said})",
        )
    if len(order) < 2:
        return False, None, "one policy: nothing to share"
    if problem is not None:
        return False, problem, f"the policies cannot share one base ({problem})"
    if engines_on_gpu(config):
        return True, None, GPU_REASON
    return False, None, CPU_REASON


def resolve_share_base(config: RLConfig, order: Sequence[str], where: str) -> RLConfig:
    """`config` with `share_base` decided for the policies of `order` (`share_base_decision`) and
    `share_base_reason` saying why; a config already decided comes back as it is. `share_base =
    true` for policies that cannot is a `RecipeError` naming the policy and key; so is an adapter the
    engine cannot serve (the engine's own `check_adapters`, e.g. vLLM's `max_lora_rank`)."""
    if config.share_base is not None and config.share_base_reason is not None:
        return config
    shared, problem, reason = share_base_decision(config, order)
    if config.share_base and problem:
        raise RecipeError(f"{where}: rl.share_base = true, but {problem}")
    if shared:
        from hpref.rl.placement.resources import engine_config

        engine_config(config).check_adapters(config, list(order), where)
    return config.model_copy(update={"share_base": shared, "share_base_reason": reason})


def share_base_line(config: RLConfig) -> str:
    """What a decided `config` says of its base: `share_base = false: <why>` (the plan, the run's log)."""
    return f"share_base = {'true' if config.share_base else 'false'}: {config.share_base_reason}"


def placement_order(config: RLConfig, order: Sequence[str]) -> list[str]:
    """The policies that get an engine and a trainer group of their own: all of them, or with a
    shared base only the leader, whose engine and group serve every policy."""
    return [order[0]] if config.share_base else list(order)


# --------------------------------------------------------------------------------------------------
# the driver's view


class _Bound:
    """`handle.<method>.remote(...)` with `adapter=` added (Ray's and `LocalActor`'s calling shape)."""

    def __init__(self, method: Any, adapter: str) -> None:
        self._method, self._adapter = method, adapter

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(*args, adapter=self._adapter, **kwargs)

    def options(self, **options: Any) -> _Bound:
        return _Bound(self._method.options(**options), self._adapter)


class AdapterEngine:
    """One policy's view of a shared-base engine: called like the policy's own engine, each call
    that acts on a policy (`ADAPTER_METHODS`) goes to its adapter. Two views of one engine compare
    equal, so a trainer group connects its weight channel once."""

    def __init__(self, handle: Any, adapter: str) -> None:
        self.handle, self.adapter = handle, adapter

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.handle, name)
        return _Bound(method, self.adapter) if name in ADAPTER_METHODS else method

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdapterEngine) and other.handle is self.handle

    def __hash__(self) -> int:
        return id(self.handle)


def engine_of(view: Any) -> Any:
    """The engine actor behind a policy's engine (its own, or the shared one behind a view)."""
    return view.handle if isinstance(view, AdapterEngine) else view


@dataclass
class SharedBase:
    """What the policies of one shared trainer group hold in common on the driver: one start, one
    weight channel, one sync at a time through it, and the engine asleep while any of them steps
    (`rl.colocate`)."""

    started: asyncio.Future | None = None
    connected: Any = None
    sync_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    stepping: int = 0
