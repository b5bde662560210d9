"""Environments the episode tests play, registered in-process (`load_plugins(extra=[turns])`): each
says what it is for. Pure Python: the tests' cost is the tiny model's."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hpref.hookspecs import hookimpl
from hpref.rl.rollout_types import Step, Turn


class RepeatConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    turns: int = Field(2, ge=1, description="turns before the episode ends")
    say: str = Field("again", description="the observation after each turn but the last")
    role: str = Field("user", description="the observation's message role")
    scored: bool = Field(True, description="the environment gives the reward (else the run's rewards do)")


class RepeatEpisode:
    """`turns` turns, each answered by the same observation; the reward is minus the characters the
    policy wrote over all its turns (brevity, as tests/rl/test_learning.py's single-turn reward), one
    per-turn reward of 0.5 for each turn that ended at its eos, and success when every turn was empty."""

    def __init__(self, config: RepeatConfig) -> None:
        self.config = config
        self.said: list[Turn] = []

    def actor(self) -> str:
        return "policy"

    def step(self, turn: Turn) -> Step:
        self.said.append(turn)
        if len(self.said) >= self.config.turns:
            return Step(done=True)
        return Step(observation=self.config.say, role=self.config.role)

    def rewards(self) -> dict[str, float] | None:
        if not self.config.scored:
            return None
        return {"policy": -float(sum(len(t.text) for t in self.said))}

    def success(self) -> bool | None:
        return all(not t.text.strip() for t in self.said)


class Repeat:
    name = "repeat"
    roles = ("policy",)

    def __init__(self, config: RepeatConfig) -> None:
        self.config = config
        self.started: list[tuple[tuple[str, ...], dict[str, Any], int]] = []

    def start(self, prompt: tuple[str, ...], row: dict[str, Any], seed: int) -> RepeatEpisode:
        self.started.append((prompt, row, seed))
        return RepeatEpisode(self.config)


@hookimpl
def register_environments(register):
    register(name="repeat", config=RepeatConfig, build=Repeat)
