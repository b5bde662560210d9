"""Built-in learning-rate schedules, each a multiplier of the base LR over the run's total steps.

A schedule is a pure function of the optimizer step, so it is trivially resumable (the step is
saved) and testable without torch; the training loop wraps it in `torch.optim.lr_scheduler.LambdaLR`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from hpref.hookspecs import hookimpl

Multiplier = Callable[[int], float]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WarmupConfig(_Config):
    warmup_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="share of total steps spent warming up")
    warmup_steps: int | None = Field(
        None, ge=0, description="warm-up length in steps; overrides warmup_fraction"
    )

    def warmup_for(self, total_steps: int) -> int:
        if self.warmup_steps is not None:
            return min(self.warmup_steps, total_steps)
        return int(round(self.warmup_fraction * total_steps))


class ConstantConfig(WarmupConfig):
    pass


class DecayConfig(WarmupConfig):
    warmup_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="share of total steps spent warming up")
    min_ratio: float = Field(0.0, ge=0.0, le=1.0, description="final LR as a fraction of the base LR")


class CompositeConfig(_Config):
    ramp_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="share of total steps for the up-ramp")
    start_factor: float = Field(0.001, gt=0.0, le=1.0, description="multiplier at step 0")
    end_factor: float = Field(0.001, ge=0.0, le=1.0, description="multiplier at the last step")


def _warmup(step: int, warmup: int) -> float | None:
    """Linear warm-up from 1/warmup up to 1 (never 0, so no optimizer step is wasted)."""
    if step < warmup:
        return (step + 1) / warmup
    return None


def _check_total(total_steps: int) -> None:
    if total_steps < 1:
        raise ValueError(f"a schedule needs at least one step, got total_steps={total_steps}")


def build_constant(config: ConstantConfig, total_steps: int) -> Multiplier:
    """Constant learning rate, after an optional linear warm-up."""
    _check_total(total_steps)
    warmup = config.warmup_for(total_steps)

    def multiplier(step: int) -> float:
        w = _warmup(step, warmup)
        return 1.0 if w is None else w

    return multiplier


def build_linear(config: DecayConfig, total_steps: int) -> Multiplier:
    """Linear warm-up, then linear decay to min_ratio at the last step."""
    _check_total(total_steps)
    warmup = config.warmup_for(total_steps)
    decay_steps = max(1, total_steps - warmup - 1)

    def multiplier(step: int) -> float:
        w = _warmup(step, warmup)
        if w is not None:
            return w
        progress = min(1.0, (step - warmup) / decay_steps)
        return config.min_ratio + (1.0 - config.min_ratio) * (1.0 - progress)

    return multiplier


def build_cosine(config: DecayConfig, total_steps: int) -> Multiplier:
    """Linear warm-up, then half-cosine decay to min_ratio at the last step."""
    _check_total(total_steps)
    warmup = config.warmup_for(total_steps)
    decay_steps = max(1, total_steps - warmup - 1)

    def multiplier(step: int) -> float:
        w = _warmup(step, warmup)
        if w is not None:
            return w
        progress = min(1.0, (step - warmup) / decay_steps)
        return config.min_ratio + (1.0 - config.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


def build_composite(config: CompositeConfig, total_steps: int) -> Multiplier:
    """The LMSYS seed's schedule: linear start_factor→1 over ramp_fraction, then 1→end_factor."""
    _check_total(total_steps)
    ramp = max(1, int(round(config.ramp_fraction * total_steps)))
    rest = max(1, total_steps - ramp - 1)

    def multiplier(step: int) -> float:
        if step < ramp:
            return config.start_factor + (1.0 - config.start_factor) * step / ramp
        progress = min(1.0, (step - ramp) / rest)
        return 1.0 + (config.end_factor - 1.0) * progress

    return multiplier


@hookimpl
def register_schedulers(register):
    register(name="constant", config=ConstantConfig, build=build_constant)
    register(name="linear", config=DecayConfig, build=build_linear)
    register(name="cosine", config=DecayConfig, build=build_cosine)
    register(name="composite", config=CompositeConfig, build=build_composite)
