"""`debate`: two policies answer the same prompt, each then reads the other's answer and may revise
its own, and the run's pair judge gives the final pair its three-way verdict (`[rl.environment]
name = "debate", roles = { first = "a", second = "b" }`).

Round 1: both answer the prompt, neither seeing the other (the role that opens the episode acts, then
the other with no observation between them). Each later round, each role reads the other's answer of
the round before (a user message, `revise_prompt`) and writes its answer again. Which role opens is
drawn from the episode's seed, so in every round about half the episodes ask each policy for a turn:
both engines work in every round (one alternating order would leave one engine idle each round), and
on a shared base the two policies' turns go out as one batched call. After `rounds` rounds the two
last answers are judged as a pair by the run's rewards (`[rl.reward]`: a judge, or a reward export
that judges pairs; `hpref.rl.protocols.JudgedInPairs`): both orders, averaged, so the judge's
position bias cancels, and each side's reward is its P(win) + P(tie)/2: a tie is half a win for both,
and the two rewards sum to 1 (a zero-sum game around 0.5). The environment itself never scores.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hpref.rl.rollout_types import Step, Turn

Prompt = tuple[str, ...]

FIRST, SECOND = "first", "second"


class DebateConfig(BaseModel):
    """`[rl.environment] name = "debate"`: how many rounds, and what a role reads between them."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = Field(
        2,
        ge=1,
        le=8,
        description="answers each role writes: 1 = both answer once, unseen; each more round, each "
        "reads the other's latest answer and answers again",
    )
    revise_prompt: str = Field(
        "Another assistant answered the same request:\n\n{other}\n\nWrite your final answer to the "
        "request. Keep what is right in yours, take what is better in theirs.",
        description="what a role reads before it answers again ({other}: the other's latest answer)",
    )


class DebateEpisode:
    def __init__(self, config: DebateConfig, opener: str) -> None:
        self.config = config
        self.opener, self.other = opener, SECOND if opener == FIRST else FIRST
        self.answers: dict[str, list[str]] = {FIRST: [], SECOND: []}

    def actor(self) -> str:
        return self.opener if len(self.answers[self.opener]) == len(self.answers[self.other]) else self.other

    def step(self, turn: Turn) -> Step:
        self.answers[turn.role].append(turn.text.strip())
        opened, answered = self.answers[self.opener], self.answers[self.other]
        if turn.role == self.opener:
            if not answered:  # the other answers round 1 without seeing the opener's answer
                return Step(observation=None, role="user")
            # the other reads the opener's answer of the round before, not this revision: both
            # revise on what the other wrote before reading them
            return Step(observation=self.config.revise_prompt.format(other=opened[-2]), role="user")
        if len(answered) >= self.config.rounds:
            return Step(done=True)
        return Step(observation=self.config.revise_prompt.format(other=answered[-1]), role="user")

    def rewards(self) -> dict[str, float] | None:
        return None  # the run's pair judge scores the final pair (`judged_roles`)

    def success(self) -> bool | None:
        return None


class Debate:
    name = "debate"
    roles = (FIRST, SECOND)
    judged_roles = (FIRST, SECOND)

    def __init__(self, config: DebateConfig) -> None:
        self.config = config

    def start(self, prompt: Prompt, row: dict[str, Any], seed: int) -> DebateEpisode:
        """Both roles open on the prompt itself; the seed draws which acts first in each round."""
        return DebateEpisode(self.config, FIRST if seed % 2 == 0 else SECOND)


def build_debate(config: DebateConfig) -> Debate:
    """Two policies answer a prompt, read each other's answer and revise; the run's pair judge
    scores the final pair (two roles: `first`, `second`)."""
    return Debate(config)
