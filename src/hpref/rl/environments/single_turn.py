"""`single-turn`, the default environment: the prompt, one answer, the end. The run's rewards score
the answer (`rewards()` is None), so a run without `[rl.environment]` is what every rollout was
before environments existed: the same engine request, the same rewards, the same rows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from hpref.rl.rollout_types import Step, Turn

Prompt = tuple[str, ...]

ROLE = "policy"


class SingleTurnConfig(BaseModel):
    """No parameters: the prompt and one answer."""

    model_config = ConfigDict(extra="forbid")


class SingleTurnEpisode:
    def actor(self) -> str:
        return ROLE

    def step(self, turn: Turn) -> Step:
        return Step(done=True)

    def rewards(self) -> dict[str, float] | None:
        return None

    def success(self) -> bool | None:
        return None


class SingleTurn:
    name = "single-turn"
    roles = (ROLE,)

    def start(self, prompt: Prompt, row: dict[str, Any], seed: int) -> SingleTurnEpisode:
        return SingleTurnEpisode()


def build_single_turn(config: SingleTurnConfig) -> SingleTurn:
    """A prompt and one answer, scored by the run's rewards (every run's default)."""
    return SingleTurn()
