"""The synthetic arena's judge: a latent utility per answer, and Davidson's model of the outcome.

The utility is computed from the text alone (`answer_utility`): the mean over turns of 4 x correct
- 1.4 x refusal + small bonuses for politeness, markdown and length (saturating, and falling for
rambling answers). The outcome follows Davidson's Bradley-Terry model with ties: P(A) ∝ e^uA,
P(B) ∝ e^uB, P(tie) ∝ nu·e^((uA+uB)/2) (`davidson`, `judge`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hpref.arena.world import POLITE_MARKERS, REFUSALS, is_correct, parse_task
from hpref.data.records import Probs

# judge weights
W_CORRECT = 4.0
W_REFUSAL = 1.4
W_POLITE = 0.25
W_MARKDOWN = 0.1
W_LENGTH = 0.02  # per word up to LENGTH_CAP words
LENGTH_CAP = 20
RAMBLE_START = 45
W_RAMBLE = 0.03  # per word beyond RAMBLE_START
TIE_NU = 0.8


def is_refusal(answer: str) -> bool:
    return any(r in answer for r in REFUSALS)


def turn_utility(prompt_turn: str, answer: str) -> float:
    """The judge's utility of one answer to one user turn (see the module docstring)."""
    task = parse_task(prompt_turn)
    refusal = is_refusal(answer)
    u = 0.0
    if task is not None and not refusal and is_correct(task, answer):
        u += W_CORRECT
    if refusal:
        u -= W_REFUSAL
    if answer.lstrip().startswith(POLITE_MARKERS):
        u += W_POLITE
    if "**" in answer:
        u += W_MARKDOWN
    words = len(answer.split())
    u += W_LENGTH * min(words, LENGTH_CAP) - W_RAMBLE * max(0, words - RAMBLE_START)
    return u


def _as_turns(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def answer_utility(prompt: str | Sequence[str], answer: str | Sequence[str]) -> float:
    """Latent utility of one assistant's whole answer: the mean over turns of `turn_utility`.
    Missing answer turns count as empty answers."""
    turns = _as_turns(prompt)
    answers = _as_turns(answer)
    if not turns:
        return 0.0
    answers = answers + ("",) * (len(turns) - len(answers))
    return sum(turn_utility(p, a) for p, a in zip(turns, answers, strict=False)) / len(turns)


def davidson(u_a: float, u_b: float, nu: float = TIE_NU) -> Probs:
    """Davidson's Bradley-Terry model with ties: (P(A wins), P(B wins), P(tie))."""
    m = max(u_a, u_b)
    ea, eb = math.exp(u_a - m), math.exp(u_b - m)
    et = nu * math.exp((u_a + u_b) / 2 - m)
    z = ea + eb + et
    return (ea / z, eb / z, et / z)


def judge(prompt: str | Sequence[str], answer_a: str | Sequence[str], answer_b: str | Sequence[str]) -> Probs:
    """The synthetic arena's ground-truth judge: the true (p_a, p_b, p_tie) of a battle."""
    return davidson(answer_utility(prompt, answer_a), answer_utility(prompt, answer_b))
