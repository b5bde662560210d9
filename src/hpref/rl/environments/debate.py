"""`debate`: two policies answer the same prompt, each then reads the other's answer and may revise
its own, and the run's pair judge gives the final pair its three-way verdict (`[rl.environment]
name = "debate", roles = { first = "a", second = "b" }`).

Round 1: both answer the prompt, neither seeing the other (the second role's first turn follows the
first's with no observation between them). Each later round, each role reads the other's latest
answer (a user message, `revise_prompt`) and writes its answer again. After `rounds` rounds the two
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
    def __init__(self, config: DebateConfig) -> None:
        self.config = config
        self.answers: dict[str, list[str]] = {FIRST: [], SECOND: []}

    def actor(self) -> str:
        return FIRST if len(self.answers[FIRST]) == len(self.answers[SECOND]) else SECOND

    def step(self, turn: Turn) -> Step:
        self.answers[turn.role].append(turn.text.strip())
        written = len(self.answers[SECOND])
        if turn.role == FIRST:
            if written == 0:  # the second answers round 1 without seeing the first's answer
                return Step(observation=None, role="user")
            return Step(observation=self._revise(FIRST), role="user")  # the second reads the first's last
        if written >= self.config.rounds:
            return Step(done=True)
        return Step(observation=self._revise(SECOND), role="user")  # the first reads the second's last

    def _revise(self, author: str) -> str:
        """What the other role reads: `author`'s answer of the round before the reader's next one (in
        round 2 the second reads the first's round-1 answer, not its revision: both revise on what
        the other wrote unseen)."""
        written = self.answers[author]
        other = written[-2] if author == FIRST and len(written) > 1 else written[-1]
        return self.config.revise_prompt.format(other=other)

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
        """Both roles open on the prompt itself; nothing is drawn."""
        return DebateEpisode(self.config)


def build_debate(config: DebateConfig) -> Debate:
    """Two policies answer a prompt, read each other's answer and revise; the run's pair judge
    scores the final pair (two roles: `first`, `second`)."""
    return Debate(config)
