"""`signal`: the Lewis signalling game, two policies in one episode (`[rl.environment] name = "signal",
roles = { speaker = "a", listener = "b" }`).

The speaker sees the target, one of `names`, and writes a message; the listener sees the names and
the message only, and names the target; both are rewarded 1 when the listener is right, else 0. A
listener names the one of `names` its answer mentions first (case-insensitive); an answer that
mentions none is wrong. Chance is 1 / len(names): a success rate above it is information that went
from one policy to the other. `control = true` shows the listener a fixed message instead of the
speaker's: then nothing can be learned together and success stays at chance.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hpref.rl.rollout_types import Step, Turn

Prompt = tuple[str, ...]

SPEAKER, LISTENER = "speaker", "listener"


class SignalConfig(BaseModel):
    """`[rl.environment] name = "signal"`: the names a target is drawn from, and what each role reads."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(
        default_factory=lambda: ["red", "green", "blue", "yellow"],
        min_length=2,
        description="the targets, one drawn per episode from its seed; chance is 1 / their number",
    )
    speaker_prompt: str = Field(
        "The target is {target}. Your partner must pick it out of: {names}. Write a short message "
        "that tells them which one.",
        description="what the speaker reads ({target}, {names})",
    )
    listener_prompt: str = Field(
        "Your partner saw one of {names} and wrote you a message. Name the one they saw.",
        description="what the listener reads before the message ({names})",
    )
    control: bool = Field(
        False,
        description="the listener sees a fixed message instead of the speaker's (a control run: "
        "success stays at chance when nothing passes between the policies)",
    )

    @field_validator("names")
    @classmethod
    def _distinct(cls, names: list[str]) -> list[str]:
        lowered = [n.strip().lower() for n in names]
        if any(not n for n in lowered) or len(set(lowered)) < len(lowered):
            raise ValueError("the names must be distinct and not empty (compared case-insensitively)")
        return names


def named(text: str, names: list[str]) -> int | None:
    """The index of the name `text` mentions first (case-insensitive), or None."""
    lowered = text.lower()
    found = [(lowered.find(n.lower()), i) for i, n in enumerate(names)]
    found = [(at, i) for at, i in found if at >= 0]
    return min(found)[1] if found else None


class SignalEpisode:
    def __init__(self, config: SignalConfig, target: int) -> None:
        self.config, self.target = config, target
        self.message: str | None = None
        self.choice: int | None = None
        self.done = False

    def actor(self) -> str:
        return SPEAKER if self.message is None else LISTENER

    def opening(self, role: str) -> Prompt:
        names = ", ".join(self.config.names)
        if role == SPEAKER:
            return (self.config.speaker_prompt.format(target=self.config.names[self.target], names=names),)
        return (self.config.listener_prompt.format(names=names),)

    def step(self, turn: Turn) -> Step:
        if turn.role == SPEAKER:
            self.message = turn.text
            shown = "..." if self.config.control else turn.text.strip()
            return Step(observation=f"Their message: {shown}", role="user")
        self.choice = named(turn.text, self.config.names)
        self.done = True
        return Step(done=True)

    def rewards(self) -> dict[str, float] | None:
        right = float(self.success() is True)
        return {SPEAKER: right, LISTENER: right}

    def success(self) -> bool | None:
        return self.done and self.choice == self.target


class Signal:
    name = "signal"
    roles = (SPEAKER, LISTENER)

    def __init__(self, config: SignalConfig) -> None:
        self.config = config

    def start(self, prompt: Prompt, row: dict[str, Any], seed: int) -> SignalEpisode:
        """The target is drawn from the seed alone: the prompt stream only sets how many episodes."""
        return SignalEpisode(self.config, random.Random(seed).randrange(len(self.config.names)))


def build_signal(config: SignalConfig) -> Signal:
    """The Lewis signalling game: a speaker that sees the target, a listener that names it (two roles)."""
    return Signal(config)
