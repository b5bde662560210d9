"""`propose-solve`: one policy sets an arithmetic problem, another solves it (`[rl.environment] name =
"propose-solve", roles = { proposer = "a", solver = "b" }`): the self-play curriculum of the
asymmetric papers (R-Zero's challenger and solver, Absolute Zero's propose and solve roles).

The proposer reads `proposer_prompt` and writes its problem in two lines:

    Problem: (12 + 7) * 3
    Answer: 57

Its turn is played once per start and shared by the start's `group_size` episodes (`hpref.rl.
protocols.SharedTurn`): each episode is one independent attempt of the solver at that one problem, so
the solver's GRPO group compares right and wrong answers to the same problem, and s, the share of
the start's attempts that are right, says how hard the problem is for the solver now. Rewards:

- the solver: 1 when the last number of its answer is the problem's exact value (the rule of
  `tool.matches_reference`: `0.50` is `0.5`, `0.333` is not `1/3`), else 0;
- the proposer: 1 - |2 s - 1| for a well-formed problem (R-Zero's uncertainty reward: 1 when the
  solver is right half the time, 0 when always or never), else 0. Its rows are one per start and
  the rollout's starts are one group: its problems are compared with each other.

Well formed: the `Problem:` line is an expression the calculator evaluates exactly (`calculator.
calculate`: numbers, + - * / // % ** and parentheses, bounded in size) and the `Answer:` line's
number is that value. The proposer states the answer, and is held to it, so that it must solve its
own problem: rewarded for problems alone it would learn to write expressions nobody, itself
included, can evaluate, which the solver misses half the time by luck; a stated answer checked
exactly against the calculator keeps the curriculum inside what the proposer can compute (the
environment, not the proposer, is the ground truth, as Absolute Zero's code executor is). A turn cut
at `max_new_tokens` is not judged (its last number may be cut mid-digits): a cut proposal is not
well formed, a cut answer is wrong.

The prompt stream only sets how many starts a rollout has (its text is not read, as in `signal`):
every problem is the proposer's. An episode whose problem is not well formed ends after the
proposer's turn; the solver's row is then its opening alone (no tokens to train on, reward 0).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hpref.rl.environments.calculator import calculate
from hpref.rl.environments.tool import last_number
from hpref.rl.rollout_types import Step, Turn

Prompt = tuple[str, ...]

PROPOSER, SOLVER = "proposer", "solver"
_PROBLEM = re.compile(r"^\s*problem\s*:\s*(?P<text>.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_ANSWER = re.compile(r"^\s*answer\s*:\s*(?P<text>.+?)\s*$", re.IGNORECASE | re.MULTILINE)


class ProposeSolveConfig(BaseModel):
    """`[rl.environment] name = "propose-solve"`: what each role reads."""

    model_config = ConfigDict(extra="forbid")

    proposer_prompt: str = Field(
        "Write a new arithmetic problem for a student: one expression with whole numbers and "
        "+ - * / and parentheses, neither trivial nor too hard. Reply in exactly two lines:\n"
        "Problem: <the expression>\nAnswer: <its exact value>\n"
        "For example:\nProblem: (12 + 7) * 3\nAnswer: 57",
        description="what the proposer reads; its reply must hold a 'Problem:' line and an 'Answer:' line",
    )
    solver_prompt: str = Field(
        "What is {problem}? Reply with the final answer as a number.",
        description="what the solver reads ({problem}: the proposer's expression)",
    )

    @field_validator("solver_prompt")
    @classmethod
    def _shows_the_problem(cls, text: str) -> str:
        try:
            shown = text.format(problem="\0")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"takes one placeholder, {{problem}} ({type(exc).__name__}: {exc})") from None
        if "\0" not in shown:
            raise ValueError("must show the problem: put {problem} in it")
        return text


def read_problem(text: str) -> tuple[str, Fraction] | None:
    """(expression, its exact value) of a proposal, or None when it is not well formed: no
    `Problem:` line the calculator evaluates, no `Answer:` line, or a stated answer that is not the
    expression's value."""
    problem, answer = _PROBLEM.search(text), _ANSWER.search(text)
    if problem is None or answer is None:
        return None
    try:
        value = calculate(problem["text"])
    except ValueError:
        return None
    return (problem["text"], value) if last_number(answer["text"]) == value else None


def uncertainty(valid: bool, solved: Sequence[bool]) -> float:
    """The proposer's reward: 1 - |2 s - 1|, s the share of `solved` attempts, for a valid problem;
    0 for one that is not."""
    if not valid or not solved:
        return 0.0
    s = sum(solved) / len(solved)
    return 1.0 - abs(2.0 * s - 1.0)


class ProposeSolveEpisode:
    def __init__(self, config: ProposeSolveConfig) -> None:
        self.config = config
        self.proposal: str | None = None  # the proposer's text, once it has written it
        self.problem: tuple[str, Fraction] | None = None
        self.right: bool | None = None  # the solver's answer, once judged

    def actor(self) -> str:
        return PROPOSER if self.proposal is None else SOLVER

    def opening(self, role: str) -> Prompt:
        if role == PROPOSER:
            return (self.config.proposer_prompt,)
        shown = self.problem[0] if self.problem is not None else ""  # not well formed: never answered
        return (self.config.solver_prompt.format(problem=shown),)

    def step(self, turn: Turn) -> Step:
        if turn.role == PROPOSER:
            self.proposal = turn.text
            self.problem = read_problem(turn.text) if turn.finished else None
            if self.problem is None:
                return Step(done=True)
            return Step(observation=None, role="user")  # the solver opens on the problem (`opening`)
        self.right = turn.finished and last_number(turn.text) == self.problem[1]  # type: ignore[index]
        return Step(done=True)

    def rewards(self) -> dict[str, float] | None:
        """This episode alone (an eval's one attempt): s is 0 or 1, so the proposer's reward is 0;
        a rollout's rewards are `ProposeSolve.start_rewards`' over the start's attempts."""
        solved = [bool(self.right)]
        return {PROPOSER: uncertainty(self.problem is not None, solved), SOLVER: float(solved[0])}

    def success(self) -> bool | None:
        return bool(self.right)


class ProposeSolve:
    name = "propose-solve"
    roles = (PROPOSER, SOLVER)
    shared_role = PROPOSER

    def __init__(self, config: ProposeSolveConfig) -> None:
        self.config = config

    def start(self, prompt: Prompt, row: dict[str, Any], seed: int) -> ProposeSolveEpisode:
        """Nothing is drawn and the prompt is not read: the problem is the proposer's."""
        return ProposeSolveEpisode(self.config)

    def start_rewards(self, episodes: Sequence[ProposeSolveEpisode]) -> list[dict[str, float]]:
        """Each attempt's rewards: the solver's its own, the proposer's the uncertainty over all of
        them (the one problem they share)."""
        problems = {e.proposal for e in episodes}
        if len(problems) != 1:
            raise RuntimeError(f"propose-solve: a start's episodes hold {len(problems)} problems, not one")
        solved = [bool(e.right) for e in episodes]
        proposer = uncertainty(episodes[0].problem is not None, solved)
        return [{PROPOSER: proposer, SOLVER: float(right)} for right in solved]


def build_propose_solve(config: ProposeSolveConfig) -> ProposeSolve:
    """A proposer writes an arithmetic problem and its answer, a solver answers it `group_size` times
    (two roles: `proposer`, `solver`); the proposer is rewarded for problems solved half the time."""
    return ProposeSolve(config)
