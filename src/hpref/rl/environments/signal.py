"""`signal`: the Lewis signalling game, two policies in one episode (`[rl.environment] name = "signal",
roles = { speaker = "a", listener = "b" }`).

The speaker sees the target, one of `names`, and writes a message; the listener sees the names and
the message only, and names the target; both are rewarded 1 when the listener is right, else 0. A
listener names the one of `names` its answer mentions first (case-insensitive); an answer that
mentions none is wrong. Chance is 1 / len(names): a success rate above it is information that went
from one policy to the other. `control = true` is the control run: the listener reads a shuffled
message, one the speaker wrote about a target drawn apart from the listener's, so nothing can be
learned together and success stays at chance.

Two tiny random-init policies learn it (tests/rl/environments/test_signal.py, recipes/rl-signal.toml)
when the speaker's first messages already differ with the target, however little. Measured on hpref's
tiny policies at their random init (a byte-level tokenizer: one token per character; four seeds):
the speaker's full next-token distributions for two targets differ by at most 0.0002 bit whatever
the prompt, so its messages carry nothing, the listener settles on always naming one target (success
1/K, the pooling equilibrium) and neither policy has a gradient out of it. Sampled from its 4
likeliest tokens (`top_k = 4`, a small alphabet whose messages repeat, so the listener can learn
to read them), the speaker reading the target alone differs by 0.24 bit in three seeds of four; behind
"The target is ...", by 0 in all four (and it does not learn). So the speaker's default prompt is the
target alone, and the recipe samples the speaker with `top_k`.
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
        "{target}",
        description="what the speaker reads ({target}, {names}); the target alone by default: a "
        "random-init speaker hears little of one token among many (the module's docstring)",
    )
    listener_prompt: str = Field(
        "Which of {names}?",
        description="what the listener reads before the message ({names})",
    )
    control: bool = Field(
        False,
        description="the control run: the listener reads a shuffled message, one the speaker wrote "
        "about a target drawn apart from the listener's (success stays at chance when nothing "
        "passes between the policies)",
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
    """One game: `target` is what the listener must name, `shown` the target the speaker reads (the
    same one, except in a control run)."""

    def __init__(self, config: SignalConfig, target: int, shown: int) -> None:
        self.config, self.target, self.shown = config, target, shown
        self.message: str | None = None
        self.choice: int | None = None
        self.done = False

    def actor(self) -> str:
        return SPEAKER if self.message is None else LISTENER

    def opening(self, role: str) -> Prompt:
        names = ", ".join(self.config.names)
        if role == SPEAKER:
            return (self.config.speaker_prompt.format(target=self.config.names[self.shown], names=names),)
        return (self.config.listener_prompt.format(names=names),)

    def step(self, turn: Turn) -> Step:
        if turn.role == SPEAKER:
            self.message = turn.text
            return Step(observation=f"Their message: {turn.text.strip()}", role="user")
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
        """The target is drawn from the seed alone: the prompt stream only sets how many episodes.

        A control episode's speaker is shown a second draw of the same seed, independent of the
        target: the listener then reads a message distributed as another episode's would be (a
        shuffle), drawn so that a regenerated rollout replays it. Shuffling the messages themselves
        would need every speaker's turn before any listener's observation, which a turn's `Step`
        hands over as the speaker ends it."""
        draw = random.Random(seed)
        target = draw.randrange(len(self.config.names))
        shown = draw.randrange(len(self.config.names)) if self.config.control else target
        return SignalEpisode(self.config, target, shown)


def build_signal(config: SignalConfig) -> Signal:
    """The Lewis signalling game: a speaker that sees the target, a listener that names it (two roles)."""
    return Signal(config)
