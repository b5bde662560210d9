"""The policies one trainer holds: a `PolicySlot` each (its settings, optimizer, counters and
algorithm) — one for a policy of its own, one per LoRA policy of a shared base (`rl.share_base`) —
and, on such a base, their PEFT adapters over the one model (`add_adapters`). `TrainerActor` works on
one slot at a time (`select`); `slot_attribute` makes the active slot's fields the trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpref.errors import UserError
from hpref.recipe.rl import PolicyConfig

if TYPE_CHECKING:
    from torch import nn


@dataclass
class PolicySlot:
    """What a trainer keeps for each policy it trains: one, or on a shared base (`rl.share_base`)
    one per adapter, each with its own settings, optimizer and counters."""

    policy: str
    config: PolicyConfig
    optimizer: Any = None
    trainable: list[Any] = field(default_factory=list)
    rollouts_done: int = 0
    version: int = 0
    #: how it learns (`hpref.rl.protocols.Algorithm`, the policy's `algorithm`)
    algorithm: Any = None

    def __post_init__(self) -> None:
        if self.algorithm is None:
            from hpref.rl.algorithms.registry import build_algorithm

            self.algorithm = build_algorithm(self.policy, self.config)


def slot_attribute(name: str) -> property:
    """An attribute of the policy the trainer is working on (`TrainerActor.active`)."""

    def get(self: Any) -> Any:
        return getattr(self.active, name)

    def put(self: Any, value: Any) -> None:
        setattr(self.active, name, value)

    return property(get, put, doc=f"the active policy's `{name}` (`PolicySlot`)")


def add_adapters(model: nn.Module, slots: dict[str, PolicySlot], active: str, shared: bool) -> Any:
    """PEFT's adapters on `model`, in place; returns PEFT's handle. One ("default") for a policy of its
    own, one per policy (named by its id) on a shared base, each drawn under the base's seed as a
    policy of its own is, so a policy starts alike either way; `active` is the one PEFT runs."""
    from loguru import logger

    from hpref.models.adapters import count_parameters
    from hpref.models.lm_adapters import add_lm_adapter, apply_lora_to_causal_lm

    lora = None
    for i, slot in enumerate(slots.values()):
        settings, name = slot.config.lora, slot.policy if shared else None
        assert settings is not None
        try:
            if i == 0:
                lora = apply_lora_to_causal_lm(model, settings, seed=slot.config.model.seed, adapter=name)
            else:
                add_lm_adapter(lora, model, settings, slot.policy, seed=slot.config.model.seed)
        except UserError as exc:
            raise UserError(f"rl.policies.{slot.policy}.{exc}") from None
    assert lora is not None
    first = slots[active]
    trainable, total = count_parameters(model)
    targets = sorted(next(iter(lora.peft_config.values())).target_modules)
    who = f"policies {', '.join(slots)} (one shared base)" if shared else f"policy '{first.policy}'"
    assert first.config.lora is not None
    logger.info(
        f"{who}: LoRA r={first.config.lora.r} on {', '.join(targets)}: "
        f"{trainable:,} of {total:,} parameters train ({trainable / total:.2%})"
    )
    if shared:
        lora.set_adapter(first.policy)
    return lora
